#!/usr/bin/env bash
# Prints the cmake flags that build llama.cpp for this machine's CPU without GGML_NATIVE: each
# instruction set only where /proc/cpuinfo lists it (AVX2, FMA, F16C, BMI2, AVX-512 with VNNI,
# BF16 and VBMI), never AMX and never AVX-VNNI on AMD. A GGML_NATIVE=ON build on an AMX machine
# in a VM crashes in llama_decode (the VM does not give the process AMX tile state), so AMX stays
# off whatever the CPU reports; AVX-VNNI (the 256-bit VEX form) stays off on AMD, where the
# AVX-512 VNNI path is the one to use.
set -euo pipefail
cpuinfo="${CPUINFO:-/proc/cpuinfo}"
flags=$(grep -m1 '^flags' "$cpuinfo" 2>/dev/null || true)
vendor=$(grep -m1 '^vendor_id' "$cpuinfo" 2>/dev/null | awk '{print $NF}' || true)
has() { [[ " $flags " == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
out="-DGGML_NATIVE=OFF -DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2) -DGGML_FMA=$(onoff fma)"
out+=" -DGGML_F16C=$(onoff f16c) -DGGML_BMI2=$(onoff bmi2)"
if has avx512f; then
  out+=" -DGGML_AVX512=ON"
  out+=" -DGGML_AVX512_VNNI=$(onoff avx512_vnni) -DGGML_AVX512_BF16=$(onoff avx512_bf16)"
  out+=" -DGGML_AVX512_VBMI=$(onoff avx512vbmi)"
else
  out+=" -DGGML_AVX512=OFF"
fi
if [ "$vendor" = "AuthenticAMD" ]; then
  out+=" -DGGML_AVX_VNNI=OFF"
else
  out+=" -DGGML_AVX_VNNI=$(onoff avx_vnni)"
fi
out+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
echo "$out"
