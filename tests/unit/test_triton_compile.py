"""Every Triton kernel of the CUDA backend compiles for sm_80 and sm_90, without a GPU.

The other tests run the kernels in Triton's interpreter, which accepts code the compiler
rejects (a loop-carried value that changes type, for one); this compiles them with Triton's own
ptxas in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Compiles each kernel for sm_80 and sm_90 with triton's own ptxas: no GPU needed.
_COMPILE_CHECK = """
import re
import sys

from kernel_registers import compile_like_runtime
from tokenmill.attention import triton_decode as td
from tokenmill.attention import triton_kernels as tk
from tokenmill.attention import triton_prefill as tp
from tokenmill.attention.decode_tuning import DEFAULT_LAUNCH, TUNED_DIR, load_tuning
from tokenmill.models import fused_ops as fo
from tokenmill.models import triton_gemm as tg
from tokenmill.quant import fp8_kernels as fk
from tokenmill.runner import greedy_kernels as gk
from tokenmill.runner import l2_prefetch as l2

# bf16, 32 query heads over 8 KV heads, a head dim of 80 (padded to 128 inside the kernels),
# the attention kernels with the warps they are launched with.
W = {"num_warps": tp.NUM_WARPS}


def decode(head_dim=128, partition=512, block_n=DEFAULT_LAUNCH.block_n, fp16=False,
           preload=False, direct=False):
    # The decode split kernel's constexprs for 32 query heads over 8 KV heads.
    return dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=head_dim, BLOCK_SIZE=16, PARTITION=partition,
                BLOCK_G=16, BLOCK_N=min(block_n, partition), BLOCK_D=128,
                DOT_PRECISION="tf32", FP16=fp16, TABLE_SPAN=partition // 16 if preload else 0,
                ROW_ALIGN=16, DIRECT=direct)


def prefill(head_dim=128, fp16=False):
    # The prefill kernel's constexprs for GQA groups of 4, as prefill_attention launches it.
    return dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=32,
                BLOCK_D=128, DOT_PRECISION="tf32", FP16=fp16, CHUNK=tp._PREFILL_CHUNK,
                CHUNK_SPAN=tp._PREFILL_CHUNK // 16, ROW_ALIGN=16)


KERNELS = [
    (tk._store_kv_kernel, dict(NUM_HEADS=8, HEAD_DIM=80, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128,
                               SATURATE=False)),
    # The rotary embedding in the store's kernel (what the model's layers launch).
    (tk._rotary_store_kv_kernel, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=80,
                                      BLOCK_SIZE=16, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=64,
                                      SATURATE=False)),
    (td._decode_split_kernel, decode(head_dim=80), W),
    # One partition for every context: the output written by the split kernel itself.
    (td._decode_split_kernel, decode(head_dim=80, direct=True), W),
    (td._decode_reduce_kernel, dict(NUM_HEADS=32, HEAD_DIM=80, PARTITION=512, BLOCK_D=128)),
    (tp._prefill_kernel, prefill(head_dim=80), W),
    # The layers' fused kernels, at Llama-3.1-8B's widths.
    (fo._rms_norm_kernel, dict(HAS_RESIDUAL=True, FP8_OUT=False, BLOCK=4096)),
    (fo._silu_and_mul_kernel, dict(BLOCK=1024)),
    (fo._rotary_kernel, dict(NUM_HEADS=48, HALF=64, BLOCK_H=64, BLOCK_D=64)),
    # Qwen3-0.6B's per-head norm of q and k: 16 + 8 heads of 128.
    (fo._head_rms_norm_kernel, dict(NUM_Q=16, NUM_HEADS=24, DIM=128, BLOCK_H=32, BLOCK_D=128)),
]
# An fp8 KV cache (--kv-cache-dtype fp8): stored with saturation, widened to fp16 (FP16) or
# to the queries' bf16 when read.
FP8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
# fp8 linears' activations (quantization fp8): quantized by their own kernel, or by the norm
# and SiLU-and-mul kernels that produce them, launched as quantize_rows_fp8 and fused_ops do.
KERNELS += [
    (kernel, dict(BLOCK=block, ONE_PASS=one_pass), {"num_warps": warps}, {ptr: "*fp8e4nv"})
    for kernel, ptr in ((fk._quantize_rows_kernel, "q_ptr"),
                        (fo._silu_and_mul_fp8_kernel, "out_ptr"))
    # Llama-3.1-8B's rows (4,096 and 14,336 columns) in one pass, longer ones in two.
    for block, warps, one_pass in (fo.fp8_row_launch(4096), fo.fp8_row_launch(14336),
                                   fo.fp8_row_launch(65536))
] + [
    (fo._rms_norm_kernel, dict(HAS_RESIDUAL=residual, FP8_OUT=True, BLOCK=4096), None,
     {"out_ptr": "*fp8e4nv"})
    for residual in (True, False)
]
# The decode launches tuned per GPU model (tokenmill/attention/tuned/), the fp8 cache's too.
for path in sorted(TUNED_DIR.glob("*.json")):
    tuning = load_tuning(path)
    for fp8, rules in ((False, tuning.rules), (True, tuning.fp8_rules)):
        for launch in (rule.launch for rule in rules):
            KERNELS.append((td._decode_split_kernel, decode(
                partition=launch.partition_size, block_n=launch.block_n,
                fp16=fp8 and launch.fp8_compute == "fp16", preload=launch.preload_table),
                {"num_warps": launch.num_warps, **(
                    {} if launch.num_stages is None else {"num_stages": launch.num_stages}), **(
                    {} if launch.max_registers is None else {"maxnreg": launch.max_registers})},
                FP8 if fp8 else {}))
KERNELS += [
    (tk._store_kv_kernel, dict(NUM_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128,
                               SATURATE=True), None, FP8),
    (tk._rotary_store_kv_kernel, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128,
                                      BLOCK_SIZE=16, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=64,
                                      SATURATE=True), None, FP8),
] + [
    (td._decode_split_kernel, decode(fp16=fp16, direct=direct), W, FP8)
    for fp16 in (True, False) for direct in (False, True)
] + [
    # A register cap (decode tuning's max_registers, Triton's maxnreg) on the fp8 cache's
    # long tile: the compiler spills instead of failing.
    (td._decode_split_kernel, decode(partition=1024, block_n=128, fp16=True),
     {"num_warps": 4, "num_stages": 2, "maxnreg": 128}, FP8),
] + [
    # The partition's block ids read before the loop (decode tuning's preload_table), on
    # caches whose strides are multiples of 16 (ROW_ALIGN) and on others.
    (td._decode_split_kernel, dict(decode(partition=1024, block_n=64, fp16=fp8, preload=True),
                                   ROW_ALIGN=align), {"num_warps": 4, "num_stages": 3},
     FP8 if fp8 else {})
    for fp8 in (True, False) for align in (16, 1)
] + [
    (tp._prefill_kernel, prefill(fp16=fp16), W, FP8)
    for fp16 in (True, False)
]
# The matmul (models/triton_gemm.py) at tiles its sweeps try: fp8 with scales, with and
# without a bias; bf16 without scales, a decode step's 16-row tiles (plain, the SiLU prologue,
# the norm prologue without and with the residual add).
KERNELS += [
    (tg._matmul_kernel, dict(HAS_SCALES=True, HAS_BIAS=bias, SILU_MUL=False, NORM=False,
                             HAS_RESIDUAL=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8),
     {"num_warps": w, "num_stages": st},
     {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32"})
    for bm, bn, bk, w, st in ((16, 32, 256, 4, 4), (64, 64, 128, 4, 4), (128, 128, 128, 8, 3))
    for bias in (False, True)
] + [
    (tg._matmul_kernel, dict(HAS_SCALES=False, HAS_BIAS=False, SILU_MUL=silu, NORM=norm,
                             HAS_RESIDUAL=residual, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                             GROUP_M=1), {"num_warps": w, "num_stages": st})
    for bn, bk, w, st in ((16, 1024, 4, 2), (32, 256, 2, 5), (128, 128, 4, 4))
    for silu, norm, residual in ((False, False, False), (True, False, False),
                                 (False, True, False), (False, True, True))
]
# The sampler's greedy step (argmax + its logprob), as greedy_with_logprobs launches it: on
# logits of each dtype, a whole row per program (FINAL: the ids stand in for the unused
# part_idx) or a part of one, and the parts' merge.
GREEDY = {"ids_ptr": "*i64", "lp_ptr": "*fp32", "part_max_ptr": "*fp32",
          "part_sum_ptr": "*fp32", "part_idx_ptr": "*i32"}
KERNELS += [
    (gk._greedy_scan_kernel, dict(BLOCK=2048, FINAL=final), {"num_warps": 8},
     dict(GREEDY, x_ptr=x, part_idx_ptr="*i64" if final else "*i32"))
    for final in (True, False) for x in ("*bf16", "*fp16", "*fp32")
] + [(gk._greedy_combine_kernel, dict(BLOCK_P=64), {"num_warps": 1}, GREEDY)]
# The experimental L2 prefetch's read (runner/l2_prefetch.py), on a bf16 weight.
KERNELS.append((l2._touch_kernel, dict(BLOCK=l2.BLOCK), {"num_warps": 4}, {"out_ptr": "*fp32"}))


# The checks, each a job; this process runs every SHARDS-th of them from SHARD on (the test
# starts one process a core: a compile is single-threaded).
JOBS = []


def job(fn):
    JOBS.append(fn)
    return fn


def options_of(extra):
    return extra[0] if extra else None


def pointers_of(extra):
    return extra[1] if len(extra) > 1 else {}


# Each kernel as the launcher compiles it (benchmarks/gpu/kernel_registers.py): with its
# pointers and strides marked aligned (the code that vectorizes and pipelines its loads), and
# without (a launch whose pointers or strides are not).
for fn, constexprs, *extra in KERNELS:
    # fp8 (e4m3) needs sm_89 or later: the engine refuses an fp8 cache below that.
    for arch in (90,) if "*fp8e4nv" in pointers_of(extra).values() else (80, 90):
        for aligned in (False, True):
            job(lambda fn=fn, constexprs=constexprs, extra=extra, arch=arch, aligned=aligned:
                compile_like_runtime(fn, constexprs, options_of(extra), pointers_of(extra),
                                     arch, aligned))


def check_pdl(fn, constexprs, extra):
    # As pdl.launch_options launches it: the constexpr, and Triton's launch option.
    compiled = compile_like_runtime(fn, {**constexprs, "PDL": True},
                                    {**(options_of(extra) or {}), "launch_pdl": True},
                                    pointers_of(extra))
    assert compiled.metadata.launch_pdl, fn
    ptx = compiled.asm["ptx"]
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async"), len(ptx)) if i >= 0)
    assert 0 <= wait < launch < first_load, fn
    assert "griddepcontrol" not in compile_like_runtime(
        fn, constexprs, options_of(extra), pointers_of(extra)).asm["ptx"], fn


# With programmatic dependent launch (tokenmill/pdl.py, sm_90), once a kernel: each waits for
# the kernel before it, then lets the next one launch, before anything else it does.
with_pdl = set()
for fn, constexprs, *extra in KERNELS:
    if fn in with_pdl or "PDL" not in fn.arg_names:
        continue
    with_pdl.add(fn)
    job(lambda fn=fn, constexprs=constexprs, extra=extra: check_pdl(fn, constexprs, extra))
# Every kernel the engine launches takes the flag (the L2 prefetch's read runs on a stream of
# its own, outside the chain).
assert {fn for fn, *_ in KERNELS} - with_pdl == {l2._touch_kernel}, {fn for fn, *_ in KERNELS} - with_pdl


def check_prefetch(constexprs):
    # The matmul with PDL may ask L2 for its rows of the weight before it waits (the weight
    # is never written): the prefetches, then the wait, then the loads.
    fp8 = constexprs["HAS_SCALES"]
    ptx = compile_like_runtime(
        tg._matmul_kernel, dict(constexprs, PDL=True, PREFETCH_LINES=16),
        {"num_warps": 4, "num_stages": 4},
        {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "scale_a_ptr": "*fp32",
         "scale_b_ptr": "*fp32"} if fp8 else {}).asm["ptx"]
    last_prefetch = ptx.rfind("prefetch.global.L2::evict_last")
    wait = ptx.find("griddepcontrol.wait")
    first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async"), len(ptx)) if i >= 0)
    assert 0 <= last_prefetch < wait < first_load, (fp8, last_prefetch, wait, first_load)


for constexprs in (dict(HAS_SCALES=False, HAS_BIAS=False, SILU_MUL=False, NORM=True,
                        HAS_RESIDUAL=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1),
                   dict(HAS_SCALES=True, HAS_BIAS=False, SILU_MUL=False, NORM=False,
                        HAS_RESIDUAL=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8)):
    job(lambda constexprs=constexprs: check_prefetch(constexprs))


def check_pipelining(kernel, constexprs, in_flight):
    ttgir = compile_like_runtime(kernel, constexprs,
                                 {"num_warps": 4, "num_stages": 3}).asm["ttgir"]
    waits = [int(n) for n in re.findall(r"async_wait[^}]*num = ([0-9]+)", ttgir)]
    assert waits and (max(waits) > 0) == in_flight, (kernel, waits)


# The point of preload_table: with the block ids read before the loop, the pipeliner keeps
# the next tile's copies in flight at each wait (num > 0); reading them in the loop, each
# wait drains every copy.
# The prefill kernel reads a chunk's block ids before the loop over its tiles, for the same
# reason.
for kernel, constexprs, in_flight in (
        (td._decode_split_kernel, decode(partition=1024, block_n=64, preload=True), True),
        (td._decode_split_kernel, decode(partition=1024, block_n=64), False),
        (tp._prefill_kernel, prefill(), True)):
    job(lambda kernel=kernel, constexprs=constexprs, in_flight=in_flight:
        check_pipelining(kernel, constexprs, in_flight))

shard, shards = int(sys.argv[1]), int(sys.argv[2])
for run in JOBS[shard::shards]:
    run()
print(f"shard {shard}/{shards}: {len(JOBS[shard::shards])} of {len(JOBS)} checks passed")
"""


@pytest.mark.slow
def test_kernels_compile_for_cuda(tmp_path: Path) -> None:
    """The other tests run the interpreter, which accepts kernels the compiler rejects (a
    loop-carried value that changes type, for one)."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    import tokenmill

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = Path(tokenmill.__file__).parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "benchmarks" / "gpu"),
                                         env.get("PYTHONPATH", "")])
    # One process a core (compiles are single-threaded), sharing the cache directory.
    shards = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILE_CHECK, str(i), str(shards)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(shards)]
    try:
        results = [(p.communicate(timeout=300), p.returncode) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for (out, err), code in results:
        assert code == 0, err[-3000:]
        assert "checks passed" in out, out
