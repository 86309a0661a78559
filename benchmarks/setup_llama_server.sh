#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the peer of `tokenmill bench structured --llama-server PATH`
# and of `bench compare`'s multi-stream runs) and its tools `llama-quantize`, `llama-perplexity`,
# `llama-cli` and `llama-bench` (the K-quant files and the perplexity reference of
# benchmarks/results/kquant-perplexity.md), from the llama.cpp tree vendored in the
# llama-cpp-python sdist (the same llama.cpp that benchmarks/setup_peers.sh builds).
#
# Usage: bash benchmarks/setup_llama_server.sh [WORKDIR]     (default: benchmarks/.peers)
#   -> prints the path of the built server, WORKDIR/llama.cpp-build/bin/llama-server; the tools
#      are beside it. LLAMA_TARGETS in the environment picks other targets (a space-separated list).
#
# CPU flags: GGML_NATIVE=OFF with the instruction sets named one by one
# (benchmarks/llama_cpu_flags.sh: the AVX2 set, AVX-512/VNNI/BF16 where the CPU has them, never
# AMX, whose native build crashes in a VM, never AVX-VNNI on AMD); LLAMA_CPU_FLAGS in the
# environment overrides them.
# No curl/OpenSSL (models are local files) and no web UI (no npm, no download at build time).
# Takes ~15-25 minutes on 2 cores at nice 19.
set -euo pipefail

work="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/.peers}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
build="$work/llama.cpp-build"
targets="${LLAMA_TARGETS:-llama-quantize llama-perplexity llama-bench llama-cli llama-server}"
flags="${LLAMA_CPU_FLAGS:-$(bash "$(dirname "${BASH_SOURCE[0]}")/llama_cpu_flags.sh")}"

mkdir -p "$work"
if [ ! -d "$src" ]; then
  # The sdist, not a wheel: it carries llama.cpp's sources in vendor/llama.cpp.
  pip download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work"
  tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
fi

# shellcheck disable=SC2086  # $flags is a list of cmake arguments
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release \
  $flags \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
# shellcheck disable=SC2086  # $targets is a list of target names
nice -n 19 cmake --build "$build" --config Release --target $targets -j2

"$build/bin/llama-server" --version
echo "$build/bin/llama-server"
