"""Registers, shared memory, occupancy and load pipelining of the CUDA backend's Triton
kernels on sm_90 (H100, H200), without a GPU.

Each kernel is compiled the way Triton's launcher would compile it for Llama-3.1-8B's shapes:
pointers 16-byte aligned and the integer arguments that are multiples of 16 marked so (the
launcher specializes on both). Without those marks the loads can be neither vectorized nor
pipelined, and the figures describe a kernel that never runs: the first version of this
script made that mistake. From the compiled kernel it reads

- registers a thread and spill bytes (local memory), from Triton's own cubin through the
  ``cuobjdump`` Triton ships (the cubin the runtime would load);
- shared memory, from Triton's metadata;
- whether the loads go through ``cp.async`` (pipelined through shared memory), from the PTX,
  and how many copy groups a wait leaves in flight (the largest ``DEPBAR.LE SB0, n`` of the
  SASS: 0 means every wait drains all copies, so no load overlaps the next tile's wait);
- programs an SM holds at once, from registers, shared memory and warps.

Run without TRITON_INTERPRET (the numbers are the installed Triton's; the device image may
have another version, so give it as ``--triton`` in notes):

    env -u TRITON_INTERPRET python benchmarks/gpu/kernel_registers.py
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.kernels.triton import attention as tk
from tokenmill.kernels.triton import attention_decode as td
from tokenmill.kernels.triton import attention_prefill as tp
from tokenmill.kernels.triton import fp8 as fk
from tokenmill.kernels.triton import fused_ops as fo
from tokenmill.kernels.triton import gemm as tg
from tokenmill.kernels.tuning.decode_attention import DEFAULT_LAUNCH

POINTERS = {"table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32",
            "tile_seq_ptr": "*i32", "tile_idx_ptr": "*i32",
            "slot_ptr": "*i64", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "scale_ptr": "*fp32"}
FLOATS = ("qk_scale", "eps", "fp8_max", "max_value")
# Integer arguments that are multiples of 16 at Llama-3.1-8B's shapes (strides of 128-wide
# heads, 4,096 and 14,336 columns, 16-token blocks), as the launcher would mark them.
ALIGNED_INTS = re.compile(r"^(stride_\w+|n_cols|N|K)$")
# Llama-3.1-8B's shapes in bf16: 32 query heads over 8 KV heads of 128, hidden 4096.
ATTN = dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_D=128, DOT_PRECISION="tf32")
DECODE = dict(ATTN, NUM_HEADS=32, GROUP=4, BLOCK_G=16, FP16=False, TABLE_SPAN=0, ROW_ALIGN=16,
              DIRECT=False)
PREFILL = dict(ATTN, GROUP=4, FP16=False, CHUNK=tp._PREFILL_CHUNK,
               CHUNK_SPAN=tp._PREFILL_CHUNK // 16, ROW_ALIGN=16)
# An fp8 (e4m3) cache, widened to fp16 (FP16) or to the queries' bf16.
FP8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
# An SM of compute capability 9.0: registers, shared memory (of which 1 KB is reserved a
# program), warps and programs.
SM_REGISTERS, SM_SHARED, SHARED_RESERVED, SM_WARPS, SM_PROGRAMS = 65536, 233472, 1024, 64, 32


def decode(partition: int, block_n: int, warps: int, stages: int | None = None,
           fp8: bool = False, preload: bool = False, maxnreg: int | None = None,
           ) -> tuple[str, Any, dict, dict, dict]:
    """A case of the decode split kernel as ``decode_attention`` launches it."""
    label = (f"decode split {partition}/{block_n}/{warps}w/{stages or 'default'}s"
             + (", fp8 cache to fp16" if fp8 else "") + (", preloaded table" if preload else "")
             + (f", maxnreg {maxnreg}" if maxnreg else ""))
    constexprs = dict(DECODE, PARTITION=partition, BLOCK_N=block_n, FP16=fp8,
                      TABLE_SPAN=partition // 16 if preload else 0)
    options = {"num_warps": warps, **({"num_stages": stages} if stages else {}),
               **({"maxnreg": maxnreg} if maxnreg else {})}
    return label, td._decode_split_kernel, constexprs, options, FP8 if fp8 else {}


# (label, kernel, constexprs, launch options, pointer types): the launches in use on an
# H200 (tokenmill/kernels/tuning/attention/nvidia-h200.json), then alternatives.
CASES = [
    ("store_kv", tk._store_kv_kernel,
     dict(NUM_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, SATURATE=False),
     {"num_warps": 4}, {}),
    decode(DEFAULT_LAUNCH.partition_size, DEFAULT_LAUNCH.block_n, DEFAULT_LAUNCH.num_warps),
    decode(256, 64, 4),
    decode(1024, 64, 4),
    decode(1024, 64, 4, 3, preload=True),
    decode(1024, 64, 4, 4, preload=True),
    decode(1024, 128, 4, 2, fp8=True),
    decode(1024, 128, 4, 3, fp8=True),
    decode(1024, 128, 4, 2, fp8=True, maxnreg=128),
    decode(1024, 128, 4, 3, fp8=True, preload=True),
    decode(1024, 128, 8, 3, fp8=True, preload=True),
    decode(1024, 64, 4, 3, fp8=True, preload=True),
    decode(1024, 64, 4, 4, fp8=True, preload=True),
    decode(1024, 64, 8, 3, fp8=True, preload=True),
    ("decode reduce", td._decode_reduce_kernel,
     dict(NUM_HEADS=32, HEAD_DIM=128, PARTITION=1024, BLOCK_D=128), {"num_warps": 4}, {}),
    ("prefill (in use)", tp._prefill_kernel,
     dict(PREFILL, BLOCK_M=tp._PREFILL_BLOCK_M, BLOCK_N=tp._PREFILL_BLOCK_N),
     {"num_warps": tp.NUM_WARPS}, {}),
    ("prefill (in use), fp8 cache to fp16", tp._prefill_kernel,
     dict(PREFILL, BLOCK_M=tp._PREFILL_BLOCK_M, BLOCK_N=tp._PREFILL_BLOCK_N, FP16=True),
     {"num_warps": tp.NUM_WARPS}, FP8),
    ("prefill 64 x 32, 4 warps", tp._prefill_kernel, dict(PREFILL, BLOCK_M=64, BLOCK_N=32),
     {"num_warps": 4}, {}),
    ("prefill 64 x 64, 4 warps", tp._prefill_kernel, dict(PREFILL, BLOCK_M=64, BLOCK_N=64),
     {"num_warps": 4}, {}),
    ("prefill 128 x 64, 8 warps", tp._prefill_kernel, dict(PREFILL, BLOCK_M=128, BLOCK_N=64),
     {"num_warps": 8}, {}),
    ("add + rms_norm", fo._rms_norm_kernel, dict(HAS_RESIDUAL=True, FP8_OUT=False, BLOCK=4096),
     {"num_warps": 4}, {}),
    ("add + rms_norm, fp8 out", fo._rms_norm_kernel,
     dict(HAS_RESIDUAL=True, FP8_OUT=True, BLOCK=4096), {"num_warps": 4},
     {"out_ptr": "*fp8e4nv"}),
    ("silu_and_mul", fo._silu_and_mul_kernel, dict(BLOCK=1024), {"num_warps": 4}, {}),
] + [
    (f"{name}, {cols:,} columns", kernel, dict(BLOCK=block, ONE_PASS=one_pass),
     {"num_warps": warps}, {ptr: "*fp8e4nv"})
    for name, kernel, ptr in (("silu_and_mul, fp8 out", fo._silu_and_mul_fp8_kernel, "out_ptr"),
                              ("quantize rows fp8", fk._quantize_rows_kernel, "q_ptr"))
    for cols in (4096, 14336, 65536)
    for block, warps, one_pass in (fo.fp8_row_launch(cols),)
] + [
    # The matmul's tiles (tokenmill/kernels/triton/gemm.py): fp8 at Llama-3.1-8B's o_proj.
    (f"fp8 scaled_mm {bm} x {bn} x {bk}, {st} stages", tg._matmul_kernel,
     dict(HAS_SCALES=True, HAS_BIAS=False, SILU_MUL=False, NORM=False, HAS_RESIDUAL=False,
          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8),
     {"num_warps": w, "num_stages": st},
     {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32"})
    for bm, bn, bk, w, st in ((64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4),
                              (128, 128, 128, 8, 3), (64, 256, 128, 8, 3))
] + [
    # bf16 at a decode step's few rows (one 16-row tile), some of gemm_bw.py's tiles: plain,
    # with the down projection's SiLU prologue, with qkv's and gate_up's add + norm prologue.
    (f"bf16 matmul {tile.block_m} x {tile.block_n} x {tile.block_k}, {tile.num_warps}w, "
     f"{tile.num_stages} stages" + {None: "", "silu": ", SiLU prologue",
                                    "norm": ", add + norm prologue"}[prologue],
     tg._matmul_kernel,
     dict(HAS_SCALES=False, HAS_BIAS=False, SILU_MUL=prologue == "silu",
          NORM=prologue == "norm", HAS_RESIDUAL=prologue == "norm", BLOCK_M=tile.block_m,
          BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m),
     {"num_warps": tile.num_warps, "num_stages": tile.num_stages}, {})
    for tile in (tg.GemmTile(16, 16, 512, 1, 4, 3), tg.GemmTile(16, 32, 256, 1, 4, 4),
                 tg.GemmTile(16, 32, 256, 1, 2, 5), tg.GemmTile(16, 64, 128, 1, 4, 5),
                 tg.GemmTile(16, 128, 128, 1, 4, 4))
    for prologue in (None, "silu", "norm")
] + [
    ("rotary", fo._rotary_kernel, dict(NUM_HEADS=48, HALF=64, BLOCK_H=64, BLOCK_D=64),
     {"num_warps": 4}, {}),
    ("q/k head rms_norm (Qwen3-0.6B)", fo._head_rms_norm_kernel,
     dict(NUM_Q=16, NUM_HEADS=24, DIM=128, BLOCK_H=32, BLOCK_D=128), {"num_warps": 4}, {}),
    ("q/k head rms_norm (Qwen3-32B)", fo._head_rms_norm_kernel,
     dict(NUM_Q=64, NUM_HEADS=72, DIM=128, BLOCK_H=128, BLOCK_D=128), {"num_warps": 16}, {}),
] + [
    (f"rotary + store_kv{', fp8 cache' if fp8 else ''}", tk._rotary_store_kv_kernel,
     dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_HQ=32,
          BLOCK_HKV=8, BLOCK_HALF=64, SATURATE=fp8), {"num_warps": 4}, FP8 if fp8 else {})
    for fp8 in (False, True)
]


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_like_runtime(fn: triton.JITFunction, constexprs: dict, options: dict | None,
                         pointers: dict | None = None, arch: int = 90,
                         aligned: bool = True) -> Any:
    """``fn`` compiled for sm_<arch> as the launcher would: with ``aligned``, pointers
    16-byte aligned and the integer arguments ALIGNED_INTS names marked as multiples of 16;
    without, nothing marked (a launch whose pointers or strides are not). Pointers are bf16
    unless POINTERS or ``pointers`` say otherwise; a constexpr not in ``constexprs`` takes its
    default (``PDL``: off). The slow compile test (tests/compile/test_triton_compile.py)
    compiles every kernel through this too."""
    types = {**POINTERS, **(pointers or {})}
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
                  **constexprs}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = (types.get(name, "*bf16") if name.endswith("_ptr")
                           else "fp32" if name in FLOATS else "i32")
        if aligned and (name.endswith("_ptr") or ALIGNED_INTS.match(name)):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs an SM of compute capability 9.0 holds at once: registers are given out per
    warp in units of 256, shared memory per program with 1 KB reserved."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = (SM_REGISTERS // per_warp) // warps
    by_shared = SM_SHARED // (shared + SHARED_RESERVED)
    return min(by_registers, by_shared, SM_WARPS // warps, SM_PROGRAMS)


def report(fn: triton.JITFunction, constexprs: dict, options: dict,
           pointers: dict | None = None) -> dict[str, Any]:
    """What the compiled kernel uses and does (see the module's docstring)."""
    kernel = compile_like_runtime(fn, constexprs, options, pointers)
    path = f"/tmp/kernel_registers_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    try:
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.remove(path)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    spills = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    waits = [int(n, 16) for n in re.findall(r"DEPBAR\.LE SB0, 0x([0-9a-f]+)", sass)]
    warps = options.get("num_warps", 4)
    return {"registers": registers, "spill_bytes": spills, "shared": kernel.metadata.shared,
            "programs_per_sm": programs_per_sm(registers, kernel.metadata.shared, warps),
            "cp_async": "cp.async" in kernel.asm["ptx"],
            "in_flight_at_wait": max(waits, default=0)}


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90, Llama-3.1-8B's shapes (bf16 unless fp8)\n")
    print("| kernel | warps | registers | spill bytes | shared KB | programs/SM | cp.async "
          "| copies in flight at a wait |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for label, fn, constexprs, options, pointers in CASES:
        r = report(fn, constexprs, options, pointers)
        print(f"| {label} | {options.get('num_warps', 4)} | {r['registers']} "
              f"| {r['spill_bytes']} | {r['shared'] / 1024:.1f} | {r['programs_per_sm']} "
              f"| {'yes' if r['cp_async'] else 'no'} | {r['in_flight_at_wait']} |")


if __name__ == "__main__":
    main()
