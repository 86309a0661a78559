"""scripts/install.sh --check: where it would install and what the machine lacks, installing
nothing. Each case runs a copy of the script in a folder of its own (it works in the folder
above scripts/), against a real interpreter: this one, a fresh virtual environment, or a copy
of this one whose standard library carries PEP 668's EXTERNALLY-MANAGED marker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install.sh"
BASH = shutil.which("bash") or "/bin/bash"


def _repo(tmp_path: Path) -> Path:
    """A folder with scripts/install.sh in it, as a clone has."""
    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "install.sh")
    return root


def _check(root: Path, python: str, *args: str, path: str | None = None,
           **env: str) -> subprocess.CompletedProcess[str]:
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "CXX", "TOKENMILL_TORCH",
                            "TOKENMILL_SKIP_CXX", "PYTHONHOME", "PYTHONPATH")}
    run_env.update(PYTHON=python, **env)
    if path is not None:
        run_env["PATH"] = path
    return subprocess.run([BASH, str(root / "scripts" / "install.sh"), "--check", *args],
                          env=run_env, capture_output=True, text=True, timeout=120)


def _managed_python(tmp_path: Path) -> Path:
    """This interpreter's binary in a prefix of its own, whose stdlib (links to this one's
    files) holds an EXTERNALLY-MANAGED marker: what Debian's and Ubuntu's python3 look like."""
    prefix = tmp_path / "system"
    stdlib = Path(sysconfig.get_path("stdlib"))
    lib = prefix / "lib" / stdlib.name
    (lib / "site-packages").mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name != "site-packages":
            (lib / entry.name).symlink_to(entry)
    (lib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=use apt\n")
    include = Path(sysconfig.get_path("include"))
    (prefix / "include").mkdir()
    (prefix / "include" / include.name).symlink_to(include)
    (prefix / "bin").mkdir()
    python = prefix / "bin" / "python3"
    shutil.copy(os.path.realpath(sys.executable), python)
    return python


def _env_for(python: Path) -> dict[str, str]:
    # The copied binary finds libpython where this one does.
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    return {"LD_LIBRARY_PATH": os.pathsep.join(
        p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)}


def _stdout_and_err(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def test_an_externally_managed_python_gets_a_venv(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    python = _managed_python(tmp_path)
    env = _env_for(python)
    probe = subprocess.run([str(python), "-c", "import sys, sysconfig; "
                            "print(sys.prefix, sysconfig.get_path('stdlib'))"],
                           env={**os.environ, **env}, capture_output=True, text=True, check=True)
    assert probe.stdout.split()[0] == str(python.parent.parent)  # a prefix of its own
    result = _check(root, str(python), **env)
    out = _stdout_and_err(result)
    assert result.returncode == 0, out
    assert "will install into a virtual environment .venv (made now)" in out
    assert "is externally managed (PEP 668: " in out and "EXTERNALLY-MANAGED)" in out
    assert "nothing was installed" in out
    assert not (root / ".venv").exists()


def test_this_python_is_used_as_it_is(tmp_path: Path) -> None:
    """This machine's interpreter (pyenv's, not externally managed): installed into, with
    launchers in .venv/bin; the check writes none of them."""
    root = _repo(tmp_path)
    python = sys.executable
    result = _check(root, python)
    out = _stdout_and_err(result)
    assert result.returncode == 0, out
    if sys.prefix != sys.base_prefix:  # the suite itself runs in a virtual environment
        assert f"will install into {sys.prefix}: it is the active venv environment" in out
    else:
        assert f"will install into {sys.prefix}: it is not externally managed" in out
    assert "launchers .venv/bin/python and .venv/bin/tokenmill" in out
    assert not (root / ".venv").exists()
    # --venv asks for a virtual environment all the same.
    out = _stdout_and_err(_check(root, python, "--venv"))
    assert "will install into a virtual environment .venv (made now): --venv was given" in out


def test_an_active_venv_is_used(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    result = _check(root, str(venv / "bin" / "python"), VIRTUAL_ENV=str(venv))
    out = _stdout_and_err(result)
    assert result.returncode == 0, out
    assert f"will install into {venv}: it is the active venv environment" in out


def test_no_compiler_stops_before_installing_and_says_how_to_get_one(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    bin_dir = tmp_path / "bin"  # a PATH with the few tools the check uses, and no c++
    bin_dir.mkdir()
    for tool in ("dirname", "uname", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    result = _check(root, os.path.realpath(sys.executable), path=str(bin_dir))
    assert result.returncode == 1
    err = result.stderr
    assert "no C++ compiler (c++, g++ or clang++)" in err
    assert "TOKENMILL_SKIP_CXX=1" in err and "stopped before installing anything" in err
    if "debian" in Path("/etc/os-release").read_text().lower():
        assert "sudo apt-get install -y g++" in err
    # Going without is a choice the message offers.
    result = _check(root, os.path.realpath(sys.executable), path=str(bin_dir),
                    TOKENMILL_SKIP_CXX="1")
    assert result.returncode == 0, _stdout_and_err(result)
    assert "C++ compiler: not needed" in result.stdout


def test_torch_build_follows_nvidia_smi_and_the_variable(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    python = os.path.realpath(sys.executable)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "uname", "id", "c++"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    out = _check(root, python, path=str(bin_dir)).stdout
    assert "the cpu build (no nvidia-smi;" in out
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = _check(root, python, path=str(bin_dir)).stdout
    assert "the cuda build (nvidia-smi found;" in out
    out = _check(root, python, path=str(bin_dir), TOKENMILL_TORCH="skip").stdout
    assert "torch: kept as it is (TOKENMILL_TORCH=skip)" in out
    result = _check(root, python, path=str(bin_dir), TOKENMILL_TORCH="rocm")
    assert result.returncode == 1
    assert "TOKENMILL_TORCH must be cpu, cuda or skip, not 'rocm'" in result.stderr


def test_unknown_options_are_refused(tmp_path: Path) -> None:
    result = _check(_repo(tmp_path), sys.executable, "--tests")
    assert result.returncode == 2 and "unknown option --tests" in result.stderr
