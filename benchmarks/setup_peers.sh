#!/usr/bin/env bash
# Install the peers that `tokenmill bench compare` measures tokenmill against, into their own
# virtual environment so tokenmill's environment is never touched by them:
#   - llama.cpp through llama-cpp-python (its `Llama` API and its OpenAI-compatible server);
#     it builds llama.cpp from source: ~5-10 minutes on 2 cores.
#   - Hugging Face transformers + accelerate (loads the same GGUF with `gguf_file=`).
#   - llama.cpp's own `llama-server` (continuous batching, `-np` slots), built from the same
#     llama.cpp tree by benchmarks/setup_llama_server.sh: the multi-stream anchor.
#
# Usage: bash benchmarks/setup_peers.sh [VENV]      (default: benchmarks/.venv-peers)
#
# The venv is made with --system-site-packages so it sees the torch 2.13.0 CPU build already
# installed, and every install is pinned by constraints.txt so no CUDA torch gets pulled in.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
venv="${1:-$here/.venv-peers}"
constraints="$root/constraints.txt"

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip

# llama.cpp: a CPU build for this machine's instruction sets (AVX2, AVX-512/VNNI/BF16 where
# present), named one by one rather than GGML_NATIVE=ON, whose AMX build crashes in a VM; no
# GPU back-end.
CMAKE_ARGS="${CMAKE_ARGS:-$(bash "$here/llama_cpu_flags.sh")}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$py" -m pip install -c "$constraints" --no-cache-dir "llama-cpp-python[server]"

"$py" -m pip install -c "$constraints" "transformers>=4.45" accelerate

"$py" - <<'PY'
import llama_cpp, torch, transformers
print(f"peers ready: llama-cpp-python {llama_cpp.__version__}, "
      f"transformers {transformers.__version__}, torch {torch.__version__}")
PY

# llama-server: the multi-stream peer (`bench compare --llama-server PATH`, default the path
# this prints).
bash "$here/setup_llama_server.sh" "$here/.peers"
