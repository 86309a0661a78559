"""Environment variables are read in one module, tokenmill/envs.py, when asked for, and
importing tokenmill (or the modules an entry point imports) changes nothing in os.environ."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tokenmill
from tokenmill import envs

PACKAGE_DIR = Path(tokenmill.__file__).parent
# The modules that may read the environment: none but envs itself.
ALLOWED_READERS = {PACKAGE_DIR / "envs.py"}

# What `tokenmill serve`, `generate`, `batch`, `stream` and the offline API load.
ENTRY_MODULES = ("tokenmill", "tokenmill.envs", "tokenmill.cli", "tokenmill.engine",
                 "tokenmill.engine.llm", "tokenmill.engine.llm_engine", "tokenmill.server.app",
                 "tokenmill.server.serve_cli", "tokenmill.batch.cli", "tokenmill.stream.cli",
                 "tokenmill.runner.model_runner", "tokenmill.quant.kernel_choice",
                 "tokenmill.runner.cpu_program")

IMPORT_PROBE = """import importlib, os
before = dict(os.environ)
for name in {modules!r}:
    importlib.import_module(name)
import tokenmill
tokenmill.LLM, tokenmill.SamplingParams
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print("changed", changed)"""


def test_importing_tokenmill_changes_nothing_in_the_environment() -> None:
    # Without the user's thread policy: the variables the package once set for itself.
    env = {k: v for k, v in os.environ.items() if k not in envs.THREAD_POLICY_VARS
           and k != envs.DEFAULTED_MARK}
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE.format(modules=ENTRY_MODULES)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "changed []"


READERS = ("environ", "environb", "getenv", "getenvb")


def _environment_reads(path: Path) -> list[str]:
    """``os.environ`` / ``os.getenv`` (and the same names imported from os) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "os" and node.attr in READERS):
            found.append(f"{path}:{node.lineno} os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{path}:{node.lineno} from os import {alias.name}"
                      for alias in node.names if alias.name in READERS]
    return found


def test_only_envs_reads_the_environment() -> None:
    reads = [hit for path in sorted(PACKAGE_DIR.rglob("*.py")) if path not in ALLOWED_READERS
             for hit in _environment_reads(path)]
    assert reads == [], "read environment variables through tokenmill.envs:\n" + "\n".join(reads)


def test_the_static_check_finds_a_read(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text("import os\nfrom os import getenv\nx = os.environ.get('A')\n"
                      "y = dict(os.environ)\n")
    assert len(_environment_reads(module)) == 3


def test_every_variable_named_in_the_package_is_listed() -> None:
    """A ``TOKENMILL_*`` name in the Python or the C++ is one of envs.VARIABLES (or the marker
    of the thread policy), so the generated docs list every switch."""
    names: set[str] = set()
    for path in PACKAGE_DIR.rglob("*"):
        if path.suffix in (".py", ".h", ".cpp"):
            text = path.read_text()
            names |= set(re.findall(r"""["']\b(TOKENMILL_[A-Z0-9_]+)["']""", text))
            names |= set(re.findall(r"getenv\(\"([A-Z0-9_]+)\"\)", text))
            names |= set(re.findall(r"env_int\(\"([A-Z0-9_]+)\"", text))
    unknown = names - set(envs.VARIABLES) - {envs.DEFAULTED_MARK}
    assert not unknown, f"add these to tokenmill/envs.py: {sorted(unknown)}"
    # The C++ thread pool's variables are among them.
    assert {"TOKENMILL_THREAD_POOL", "TOKENMILL_SPIN_US", "TOKENMILL_POOL_CHUNKS"} <= names


def test_every_variable_reads_its_default_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    got = {name: getattr(envs, name) for name in envs.VARIABLES}
    assert got["TOKENMILL_GC_FREEZE"] is True and got["TOKENMILL_PDL"] is False
    assert got["TOKENMILL_INT4_ACT_BITS"] == 16 and got["TOKENMILL_INT4_DECODE_ACT_BITS"] == 8
    assert got["TOKENMILL_PDL_PREFETCH_KB"] == 64 and got["TOKENMILL_L2_PREFETCH"] == 0
    assert got["TOKENMILL_STREAM_WEIGHTS"] is None and got["TOKENMILL_API_KEY"] is None
    assert got["XDG_CACHE_HOME"] == "/home/someone/.cache"
    for var in envs.VARIABLES.values():
        assert var.doc and var.default, var.name


def test_a_variable_is_read_when_asked_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_GC_FREEZE", "0")
    assert envs.TOKENMILL_GC_FREEZE is False
    monkeypatch.setenv("TOKENMILL_GC_FREEZE", "1")
    assert envs.TOKENMILL_GC_FREEZE is True
    monkeypatch.setenv("TOKENMILL_API_KEY", "sk-1")
    assert envs.TOKENMILL_API_KEY == "sk-1"
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/cache")
    assert envs.XDG_CACHE_HOME == "/tmp/cache"
    with pytest.raises(AttributeError, match="TOKENMILL_NO_SUCH"):
        envs.TOKENMILL_NO_SUCH  # noqa: B018


def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, bad, match in (("TOKENMILL_INT4_ACT_BITS", "4", "must be 8 or 16"),
                             ("TOKENMILL_INT4_DECODE_ACT_BITS", "x", "whole number"),
                             ("TOKENMILL_PDL_PREFETCH_KB", "-1", ">= 0"),
                             ("TOKENMILL_AMX", "maybe", "must be 0 or 1")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name} {match}|{name} must"):
            getattr(envs, name)
        monkeypatch.delenv(name)
    # The next read of a good value is answered as usual.
    monkeypatch.setenv("TOKENMILL_INT4_ACT_BITS", "8")
    assert envs.TOKENMILL_INT4_ACT_BITS == 8


def test_flag_reads_on_off_and_names_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one parser of tokenmill's on/off variables (GC freeze, fused decode and prefill)."""
    monkeypatch.delenv("TOKENMILL_TEST_FLAG", raising=False)
    assert envs.flag("TOKENMILL_TEST_FLAG", True) and not envs.flag("TOKENMILL_TEST_FLAG", False)
    for value, want in (("1", True), ("On", True), ("yes", True), ("0", False), ("off", False),
                        ("FALSE", False), ("no", False), ("auto", True), (" ", True)):
        monkeypatch.setenv("TOKENMILL_TEST_FLAG", value)
        assert envs.flag("TOKENMILL_TEST_FLAG", True) is want, value
    monkeypatch.setenv("TOKENMILL_TEST_FLAG", "maybe")
    with pytest.raises(ValueError, match="TOKENMILL_TEST_FLAG must be 0 or 1, got 'maybe'"):
        envs.flag("TOKENMILL_TEST_FLAG", True)


def test_switch_is_none_where_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The three-way form (TOKENMILL_STREAM_WEIGHTS: on, off, or decided by the model's size)."""
    for value, want in [("", None), ("auto", None), ("1", True), ("ON", True), ("0", False),
                        ("no", False)]:
        monkeypatch.setenv("TOKENMILL_TEST_SWITCH", value)
        assert envs.switch("TOKENMILL_TEST_SWITCH") is want
        assert envs.flag("TOKENMILL_TEST_SWITCH", True) is (True if want is None else want)
    monkeypatch.setenv("TOKENMILL_TEST_SWITCH", "sometimes")
    with pytest.raises(ValueError, match="TOKENMILL_TEST_SWITCH must be 0 or 1"):
        envs.switch("TOKENMILL_TEST_SWITCH")


def test_child_environ_builds_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_SPIN_US", "0")
    monkeypatch.setenv("SOMETHING_ELSE", "kept")
    env = envs.child_environ({"NO_COLOR": "1"}, drop=("TOKENMILL_SPIN_US",))
    assert env["NO_COLOR"] == "1" and env["SOMETHING_ELSE"] == "kept"
    assert "TOKENMILL_SPIN_US" not in env and os.environ["TOKENMILL_SPIN_US"] == "0"


def test_the_cpp_kernels_read_no_environment() -> None:
    """The C++ extension gets its settings from tokenmill.envs (configure_pool at load), so
    every variable is listed, validated and documented in one place."""
    sources = sorted((PACKAGE_DIR / "kernels" / "cpu").glob("*.[ch]*"))
    assert sources, "the C++ sources moved: update this test"
    reads = [f"{p.name}:{i}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\b(std::)?(secure_)?getenv\s*\(", line)]
    assert reads == [], f"environment read in C++: {reads}"
