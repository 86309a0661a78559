"""Registers and spills of the CUDA backend's Triton kernels on sm_90, without a GPU.

Compiles each kernel to PTX with Triton and assembles it with the newest ptxas Triton ships,
which reports registers per thread and spill traffic: the first thing to read about a kernel
before timing it (too many registers cap how many warps an SM keeps in flight; spills go
through local memory). Run without TRITON_INTERPRET:

    env -u TRITON_INTERPRET python benchmarks/gpu/kernel_registers.py
"""

from __future__ import annotations

import glob
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.attention import triton_kernels as tk
from tokenmill.attention.decode_tuning import DEFAULT_LAUNCH
from tokenmill.models import fused_ops as fo

POINTERS = {"table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32",
            "tile_seq_ptr": "*i32", "tile_idx_ptr": "*i32",
            "slot_ptr": "*i64", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
# Llama-3.1-8B's shapes in bf16: 32 query heads over 8 KV heads of 128, hidden 4096.
ATTN = dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_D=128, DOT_PRECISION="tf32")
DECODE = dict(ATTN, NUM_HEADS=32, GROUP=4, PARTITION=512, BLOCK_G=16, FP16=False)
PREFILL = dict(ATTN, GROUP=4, FP16=False)
# An fp8 (e4m3) cache, widened to fp16 (FP16) or to the queries' bf16.
FP8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
# (label, kernel, constexprs, num_warps): the launch configurations in use, then alternatives.
CASES = [
    ("store_kv", tk._store_kv_kernel,
     dict(NUM_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128), 4),
    ("decode split (in use)", tk._decode_split_kernel,
     dict(DECODE, BLOCK_N=DEFAULT_LAUNCH.block_n), DEFAULT_LAUNCH.num_warps),
    ("decode split, 64 keys, 4 warps", tk._decode_split_kernel, dict(DECODE, BLOCK_N=64), 4),
    ("decode split, 32 keys, 4 warps", tk._decode_split_kernel, dict(DECODE, BLOCK_N=32), 4),
    ("decode split, fp8 cache to fp16, 64 keys, 4 warps", tk._decode_split_kernel,
     dict(DECODE, BLOCK_N=64, FP16=True), 4, FP8),
    ("decode split, fp8 cache to bf16, 64 keys, 4 warps", tk._decode_split_kernel,
     dict(DECODE, BLOCK_N=64), 4, FP8),
    ("decode split, fp8 cache to fp16, 128 keys, 8 warps", tk._decode_split_kernel,
     dict(DECODE, BLOCK_N=128, FP16=True), 8, FP8),
    ("decode split, fp8 cache to bf16, 128 keys, 8 warps", tk._decode_split_kernel,
     dict(DECODE, BLOCK_N=128), 8, FP8),
    ("decode reduce", tk._decode_reduce_kernel,
     dict(NUM_HEADS=32, HEAD_DIM=128, PARTITION=512, BLOCK_D=128), 4),
    ("prefill (in use)", tk._prefill_kernel,
     dict(PREFILL, BLOCK_M=tk._PREFILL_BLOCK_M, BLOCK_N=tk._PREFILL_BLOCK_N), tk.NUM_WARPS),
    ("prefill (in use), fp8 cache to fp16", tk._prefill_kernel,
     dict(PREFILL, BLOCK_M=tk._PREFILL_BLOCK_M, BLOCK_N=tk._PREFILL_BLOCK_N, FP16=True),
     tk.NUM_WARPS, FP8),
    ("prefill 64 x 32, 4 warps", tk._prefill_kernel, dict(PREFILL, BLOCK_M=64, BLOCK_N=32), 4),
    ("prefill 64 x 64, 4 warps", tk._prefill_kernel, dict(PREFILL, BLOCK_M=64, BLOCK_N=64), 4),
    ("prefill 128 x 64, 8 warps", tk._prefill_kernel, dict(PREFILL, BLOCK_M=128, BLOCK_N=64), 8),
    ("add + rms_norm", fo._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=4096), 4),
    ("silu_and_mul", fo._silu_and_mul_kernel, dict(BLOCK=1024), 4),
    ("rotary", fo._rotary_kernel, dict(NUM_HEADS=48, HALF=64, BLOCK_H=64, BLOCK_D=64), 4),
]


def ptxas() -> str:
    """Triton's newest bundled ptxas (the default one may not read the PTX version it emits)."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends",
                                          "nvidia", "bin", "ptxas*")))
    return next((p for p in found if p.endswith("blackwell")), found[0])


def report(fn: triton.JITFunction, constexprs: dict, num_warps: int,
           pointers: dict | None = None) -> tuple[str, str]:
    """(registers per thread, spill-store bytes) of ``fn`` compiled for sm_90; ``pointers``
    overrides element types (an fp8 cache)."""
    types = {**POINTERS, **(pointers or {})}
    signature = {name: "constexpr" if name in constexprs
                 else types.get(name, "*bf16") if name.endswith("_ptr")
                 else "fp32" if name in ("qk_scale", "eps") else "i32" for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        err = subprocess.run([ptxas(), "-v", "-arch=sm_90a", ptx, "-o", ptx + ".cubin"],
                             capture_output=True, text=True).stderr
    used = next(line for line in err.splitlines() if "Used" in line)
    spill = next(line for line in err.splitlines() if "spill stores" in line)
    regs = used.split("Used ")[1].split(" registers")[0]
    stores = spill.split(",")[1].strip().split(" bytes")[0]
    return regs, stores


def main() -> None:
    print("| kernel (sm_90, bf16) | warps | registers | spill bytes |")
    print("| --- | ---: | ---: | ---: |")
    for label, fn, constexprs, warps, *pointers in CASES:
        regs, spills = report(fn, constexprs, warps, *pointers)
        print(f"| {label} | {warps} | {regs} | {spills} |")


if __name__ == "__main__":
    main()
