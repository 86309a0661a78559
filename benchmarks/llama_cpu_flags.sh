#!/usr/bin/env bash
# Prints the cmake flags that build llama.cpp for this machine's CPU without GGML_NATIVE:
# the AVX2 set always, AVX-512 (with VNNI and BF16 where present) when the CPU has it, and never
# AMX. A GGML_NATIVE=ON build on an AMX machine in a VM crashes in llama_decode (the VM does not
# give the process AMX tile state), so AMX stays off whatever the CPU reports.
set -euo pipefail
flags=$(grep -m1 '^flags' "${CPUINFO:-/proc/cpuinfo}" 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
out="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
if has avx512f; then
  out+=" -DGGML_AVX512=ON"
  if has avx512_vnni; then out+=" -DGGML_AVX512_VNNI=ON"; fi
  if has avx512_bf16; then out+=" -DGGML_AVX512_BF16=ON"; fi
  if has avx512vbmi; then out+=" -DGGML_AVX512_VBMI=ON"; fi
else
  out+=" -DGGML_AVX512=OFF"
fi
out+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
echo "$out"
