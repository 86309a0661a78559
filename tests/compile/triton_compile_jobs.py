"""The CUDA compile check: every Triton kernel of the CUDA backend compiled for sm_80 and sm_90
with Triton's own ptxas, as the launchers compile them. No GPU is needed.

Triton's interpreter (the other tests) accepts code the compiler rejects (a loop-carried value
that changes type, for one). tests/compile/test_triton_compile.py runs these jobs, one process
per core; on its own::

    PYTHONPATH=.:benchmarks/gpu python tests/compile/triton_compile_jobs.py SHARD SHARDS

Each job prints one line (``ok LABEL`` or ``FAILED LABEL: the error's first line``), so a
failure names its kernel without the whole job list.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TextIO

# A job: its label (kernel, arch, alignment) and the check that raises when it fails.
Job = tuple[str, Callable[[], object]]
# Characters of a failure's message kept: ptxas errors can run to pages.
MESSAGE_CHARS = 300


def run_shard(jobs: list[Job], shard: int, shards: int, out: TextIO = sys.stdout) -> int:
    """Run every ``shards``-th job from ``shard`` on, one line each; the number that failed."""
    mine = jobs[shard::shards]
    failed = 0
    for label, check in mine:
        try:
            check()
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next job
            failed += 1
            first = (str(e).strip().splitlines() or [""])[0][:MESSAGE_CHARS]
            print(f"FAILED {label}: {type(e).__name__}: {first}", file=out, flush=True)
        else:
            print(f"ok {label}", file=out, flush=True)
    print(f"shard {shard}/{shards}: {len(mine) - failed} of {len(mine)} checks passed "
          f"({len(jobs)} in all)", file=out, flush=True)
    return failed


def _modules() -> SimpleNamespace:
    """The kernel modules, imported only when the jobs are built (not by the unit tests that
    import run_shard under Triton's interpreter)."""
    from kernel_registers import compile_like_runtime

    from tokenmill.kernels.triton import attention as triton_kernels
    from tokenmill.kernels.triton import attention_decode as triton_decode
    from tokenmill.kernels.triton import attention_prefill as triton_prefill
    from tokenmill.kernels.triton import fp8 as fp8_kernels
    from tokenmill.kernels.triton import fused_moe, fused_ops, l2_prefetch, moe_align
    from tokenmill.kernels.triton import gemm as triton_gemm
    from tokenmill.kernels.triton import greedy as greedy_kernels
    from tokenmill.kernels.tuning.decode_attention import DEFAULT_LAUNCH, TUNED_DIR, load_tuning

    return SimpleNamespace(compile=compile_like_runtime, td=triton_decode, tk=triton_kernels,
                           tp=triton_prefill, DEFAULT_LAUNCH=DEFAULT_LAUNCH,
                           TUNED_DIR=TUNED_DIR, load_tuning=load_tuning, fo=fused_ops,
                           tg=triton_gemm, fk=fp8_kernels, gk=greedy_kernels, l2=l2_prefetch,
                           moe=fused_moe, ma=moe_align)


def _decode(m: SimpleNamespace, head_dim: int = 128, partition: int = 512,
            block_n: int | None = None, fp16: bool = False, preload: bool = False,
            direct: bool = False) -> dict[str, Any]:
    # The decode split kernel's constexprs for 32 query heads over 8 KV heads.
    block_n = m.DEFAULT_LAUNCH.block_n if block_n is None else block_n
    return dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=head_dim, BLOCK_SIZE=16, PARTITION=partition,
                BLOCK_G=16, BLOCK_N=min(block_n, partition), BLOCK_D=128,
                DOT_PRECISION="tf32", FP16=fp16, TABLE_SPAN=partition // 16 if preload else 0,
                ROW_ALIGN=16, DIRECT=direct)


def _prefill(m: SimpleNamespace, head_dim: int = 128, fp16: bool = False) -> dict[str, Any]:
    # The prefill kernel's constexprs for GQA groups of 4, as prefill_attention launches it.
    return dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=32,
                BLOCK_D=128, DOT_PRECISION="tf32", FP16=fp16, CHUNK=m.tp._PREFILL_CHUNK,
                CHUNK_SPAN=m.tp._PREFILL_CHUNK // 16, ROW_ALIGN=16)


# An fp8 KV cache (--kv-cache-dtype fp8): stored with saturation, widened to fp16 (FP16) or
# to the queries' bf16 when read.
FP8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
FP8_GEMM = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "scale_a_ptr": "*fp32",
            "scale_b_ptr": "*fp32"}


def _attention_kernels(m: SimpleNamespace) -> list[tuple]:
    # bf16, 32 query heads over 8 KV heads, a head dim of 80 (padded to 128 inside the
    # kernels), the attention kernels with the warps they are launched with.
    w = {"num_warps": m.tp.NUM_WARPS}
    return [
        (m.tk._store_kv_kernel, dict(NUM_HEADS=8, HEAD_DIM=80, BLOCK_SIZE=16, BLOCK_H=8,
                                     BLOCK_D=128, SATURATE=False)),
        # The rotary embedding in the store's kernel (what the model's layers launch).
        (m.tk._rotary_store_kv_kernel, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=80,
                                            BLOCK_SIZE=16, BLOCK_HQ=32, BLOCK_HKV=8,
                                            BLOCK_HALF=64, SATURATE=False)),
        (m.td._decode_split_kernel, _decode(m, head_dim=80), w),
        # One partition for every context: the output written by the split kernel itself.
        (m.td._decode_split_kernel, _decode(m, head_dim=80, direct=True), w),
        (m.td._decode_reduce_kernel, dict(NUM_HEADS=32, HEAD_DIM=80, PARTITION=512,
                                          BLOCK_D=128)),
        (m.tp._prefill_kernel, _prefill(m, head_dim=80), w),
        # The layers' fused kernels, at Llama-3.1-8B's widths.
        (m.fo._rms_norm_kernel, dict(HAS_RESIDUAL=True, FP8_OUT=False, BLOCK=4096)),
        (m.fo._silu_and_mul_kernel, dict(BLOCK=1024)),
        (m.fo._rotary_kernel, dict(NUM_HEADS=48, HALF=64, BLOCK_H=64, BLOCK_D=64)),
        # Qwen3-0.6B's per-head norm of q and k: 16 + 8 heads of 128.
        (m.fo._head_rms_norm_kernel, dict(NUM_Q=16, NUM_HEADS=24, DIM=128, BLOCK_H=32,
                                          BLOCK_D=128)),
    ]


def _fp8_activation_kernels(m: SimpleNamespace) -> list[tuple]:
    # fp8 linears' activations (quantization fp8): quantized by their own kernel, or by the
    # norm and SiLU-and-mul kernels that produce them, launched as quantize_rows_fp8 and
    # fused_ops do; Llama-3.1-8B's rows (4,096 and 14,336 columns) in one pass, longer ones
    # in two.
    return [
        (kernel, dict(BLOCK=block, ONE_PASS=one_pass), {"num_warps": warps}, {ptr: "*fp8e4nv"})
        for kernel, ptr in ((m.fk._quantize_rows_kernel, "q_ptr"),
                            (m.fo._silu_and_mul_fp8_kernel, "out_ptr"))
        for block, warps, one_pass in (m.fo.fp8_row_launch(4096), m.fo.fp8_row_launch(14336),
                                       m.fo.fp8_row_launch(65536))
    ] + [
        (m.fo._rms_norm_kernel, dict(HAS_RESIDUAL=residual, FP8_OUT=True, BLOCK=4096), None,
         {"out_ptr": "*fp8e4nv"})
        for residual in (True, False)
    ]


def _tuned_decode_kernels(m: SimpleNamespace) -> list[tuple]:
    # The decode launches tuned per GPU model (tokenmill/kernels/tuning/attention/), the fp8 cache's too.
    out = []
    for path in sorted(m.TUNED_DIR.glob("*.json")):
        tuning = m.load_tuning(path)
        for fp8, rules in ((False, tuning.rules), (True, tuning.fp8_rules)):
            for launch in (rule.launch for rule in rules):
                options = {"num_warps": launch.num_warps}
                if launch.num_stages is not None:
                    options["num_stages"] = launch.num_stages
                if launch.max_registers is not None:
                    options["maxnreg"] = launch.max_registers
                out.append((m.td._decode_split_kernel, _decode(
                    m, partition=launch.partition_size, block_n=launch.block_n,
                    fp16=fp8 and launch.fp8_compute == "fp16", preload=launch.preload_table),
                    options, FP8 if fp8 else {}))
    return out


def _fp8_cache_kernels(m: SimpleNamespace) -> list[tuple]:
    w = {"num_warps": m.tp.NUM_WARPS}
    return [
        (m.tk._store_kv_kernel, dict(NUM_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8,
                                     BLOCK_D=128, SATURATE=True), None, FP8),
        (m.tk._rotary_store_kv_kernel, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128,
                                            BLOCK_SIZE=16, BLOCK_HQ=32, BLOCK_HKV=8,
                                            BLOCK_HALF=64, SATURATE=True), None, FP8),
    ] + [
        (m.td._decode_split_kernel, _decode(m, fp16=fp16, direct=direct), w, FP8)
        for fp16 in (True, False) for direct in (False, True)
    ] + [
        # A register cap (decode tuning's max_registers, Triton's maxnreg) on the fp8 cache's
        # long tile: the compiler spills instead of failing.
        (m.td._decode_split_kernel, _decode(m, partition=1024, block_n=128, fp16=True),
         {"num_warps": 4, "num_stages": 2, "maxnreg": 128}, FP8),
    ] + [
        # The partition's block ids read before the loop (decode tuning's preload_table), on
        # caches whose strides are multiples of 16 (ROW_ALIGN) and on others.
        (m.td._decode_split_kernel,
         dict(_decode(m, partition=1024, block_n=64, fp16=fp8, preload=True), ROW_ALIGN=align),
         {"num_warps": 4, "num_stages": 3}, FP8 if fp8 else {})
        for fp8 in (True, False) for align in (16, 1)
    ] + [
        (m.tp._prefill_kernel, _prefill(m, fp16=fp16), w, FP8)
        for fp16 in (True, False)
    ]


def _gemm_and_sampler_kernels(m: SimpleNamespace) -> list[tuple]:
    # The matmul (models/triton_gemm.py) at tiles its sweeps try: fp8 with scales, with and
    # without a bias; bf16 without scales, a decode step's 16-row tiles (plain, the SiLU
    # prologue, the norm prologue without and with the residual add).
    gemm = [
        (m.tg._matmul_kernel, dict(HAS_SCALES=True, HAS_BIAS=bias, SILU_MUL=False, NORM=False,
                                   HAS_RESIDUAL=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                   GROUP_M=8), {"num_warps": w, "num_stages": st}, FP8_GEMM)
        for bm, bn, bk, w, st in ((16, 32, 256, 4, 4), (64, 64, 128, 4, 4), (128, 128, 128, 8, 3))
        for bias in (False, True)
    ] + [
        (m.tg._matmul_kernel, dict(HAS_SCALES=False, HAS_BIAS=False, SILU_MUL=silu, NORM=norm,
                                   HAS_RESIDUAL=residual, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                                   GROUP_M=1), {"num_warps": w, "num_stages": st})
        for bn, bk, w, st in ((16, 1024, 4, 2), (32, 256, 2, 5), (128, 128, 4, 4))
        for silu, norm, residual in ((False, False, False), (True, False, False),
                                     (False, True, False), (False, True, True))
    ]
    # The sampler's greedy step (argmax + its logprob), as greedy_with_logprobs launches it:
    # on logits of each dtype, a whole row per program (FINAL: the ids stand in for the unused
    # part_idx) or a part of one, and the parts' merge.
    greedy = {"ids_ptr": "*i64", "lp_ptr": "*fp32", "part_max_ptr": "*fp32",
              "part_sum_ptr": "*fp32", "part_idx_ptr": "*i32"}
    sampler = [
        (m.gk._greedy_scan_kernel, dict(BLOCK=2048, FINAL=final), {"num_warps": 8},
         dict(greedy, x_ptr=x, part_idx_ptr="*i64" if final else "*i32"))
        for final in (True, False) for x in ("*bf16", "*fp16", "*fp32")
    ] + [(m.gk._greedy_combine_kernel, dict(BLOCK_P=64), {"num_warps": 1}, greedy)]
    # The experimental L2 prefetch's read (runner/l2_prefetch.py), on a bf16 weight.
    prefetch = [(m.l2._touch_kernel, dict(BLOCK=m.l2.BLOCK), {"num_warps": 4},
                 {"out_ptr": "*fp32"})]
    return gemm + sampler + prefetch


def _moe_kernels(m: SimpleNamespace) -> list[tuple]:
    # The fused-MoE products (kernels/triton/fused_moe.py) at each default tile: w13 with the
    # SiLU-and-mul (a row a token, top-k 8) and w2 with the routing weights (a row a pair,
    # written in fp32).
    # Quantized experts (int8 or e4m3 weights, a float32 scale a row) at the decode tile.
    ints = {"sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "total_ptr": "*i32",
            "weights_ptr": "*fp32", "scale_ptr": "*fp32"}
    tiles = dict.fromkeys(m.moe.default_tile(pairs, 128) for pairs in (8, 4096, 65536))
    return [
        (m.moe._moe_gemm_kernel, dict(TOP_K=8 if gated else 1, GATED=gated, MUL_WEIGHT=not gated,
                                      HAS_SCALE=b != "*bf16", DOT_PRECISION="tf32",
                                      BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                      GROUP_M=t.group_m),
         {"num_warps": t.num_warps, "num_stages": t.num_stages},
         dict(ints, b_ptr=b, c_ptr="*bf16" if gated else "*fp32"))
        for t, b in [(t, "*bf16") for t in tiles] + [(next(iter(tiles)), "*i8"),
                                                     (next(iter(tiles)), "*fp8e4nv")]
        for gated in (True, False)
    ] + [
        # The grouping of a decode step's pairs by expert, one program: 8 pairs of 128
        # experts, and the most pairs and experts it takes.
        (m.ma._align_kernel, dict(BLOCK_M=16, BLOCK_P=p, BLOCK_E=e, FILL=1024),
         {"num_warps": 4}, dict(ints, ids_ptr="*i64", sorted_ids_ptr="*i32",
                                expert_ids_ptr="*i32", starts_ptr="*i32", firsts_ptr="*i32"))
        for p, e in ((16, 256), (1024, 1024))
    ]


def kernel_table(m: SimpleNamespace) -> list[tuple]:
    """``(kernel, constexprs[, options[, pointer types]])`` for every launch checked."""
    return (_attention_kernels(m) + _fp8_activation_kernels(m) + _tuned_decode_kernels(m)
            + _fp8_cache_kernels(m) + _gemm_and_sampler_kernels(m) + _moe_kernels(m))


def _options(extra: list) -> dict | None:
    return extra[0] if extra else None


def _pointers(extra: list) -> dict:
    return extra[1] if len(extra) > 1 else {}


def _compile_jobs(m: SimpleNamespace, kernels: list[tuple]) -> list[Job]:
    # Each kernel as the launcher compiles it (benchmarks/gpu/kernel_registers.py): with its
    # pointers and strides marked aligned (the code that vectorizes and pipelines its loads),
    # and without (a launch whose pointers or strides are not).
    jobs: list[Job] = []
    for index, (fn, constexprs, *extra) in enumerate(kernels):
        # fp8 (e4m3) needs sm_89 or later: the engine refuses an fp8 cache below that.
        for arch in (90,) if "*fp8e4nv" in _pointers(extra).values() else (80, 90):
            for aligned in (False, True):
                label = (f"#{index} {fn.__name__} sm_{arch} "
                         f"{'aligned' if aligned else 'unaligned'}")
                jobs.append((label, lambda fn=fn, c=constexprs, e=extra, a=arch, al=aligned:
                             m.compile(fn, c, _options(e), _pointers(e), a, al)))
    return jobs


def _check_pdl(m: SimpleNamespace, fn: Any, constexprs: dict, extra: list) -> None:
    # As pdl.launch_options launches it: the constexpr, and Triton's launch option.
    compiled = m.compile(fn, {**constexprs, "PDL": True},
                         {**(_options(extra) or {}), "launch_pdl": True}, _pointers(extra))
    assert compiled.metadata.launch_pdl, fn
    ptx = compiled.asm["ptx"]
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async"), len(ptx)) if i >= 0)
    assert 0 <= wait < launch < first_load, fn
    assert "griddepcontrol" not in m.compile(
        fn, constexprs, _options(extra), _pointers(extra)).asm["ptx"], fn


def _pdl_jobs(m: SimpleNamespace, kernels: list[tuple]) -> list[Job]:
    # With programmatic dependent launch (tokenmill/kernels/triton/pdl.py, sm_90), once a kernel: each waits
    # for the kernel before it, then lets the next one launch, before anything else it does.
    jobs: list[Job] = []
    with_pdl = set()
    for fn, constexprs, *extra in kernels:
        if fn in with_pdl or "PDL" not in fn.arg_names:
            continue
        with_pdl.add(fn)
        jobs.append((f"{fn.__name__} with PDL",
                     lambda fn=fn, c=constexprs, e=extra: _check_pdl(m, fn, c, e)))
    # Every kernel the engine launches takes the flag (the L2 prefetch's read runs on a stream
    # of its own, outside the chain).
    without = {fn.__name__ for fn, *_ in kernels if fn not in with_pdl}
    assert without == {m.l2._touch_kernel.__name__}, f"kernels without a PDL flag: {without}"
    return jobs


def _check_prefetch(m: SimpleNamespace, constexprs: dict) -> None:
    # The matmul with PDL may ask L2 for its rows of the weight before it waits (the weight
    # is never written): the prefetches, then the wait, then the loads.
    fp8 = constexprs["HAS_SCALES"]
    ptx = m.compile(m.tg._matmul_kernel, dict(constexprs, PDL=True, PREFETCH_LINES=16),
                    {"num_warps": 4, "num_stages": 4}, FP8_GEMM if fp8 else {}).asm["ptx"]
    last_prefetch = ptx.rfind("prefetch.global.L2::evict_last")
    wait = ptx.find("griddepcontrol.wait")
    first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async"), len(ptx)) if i >= 0)
    assert 0 <= last_prefetch < wait < first_load, (fp8, last_prefetch, wait, first_load)


def _check_pipelining(m: SimpleNamespace, kernel: Any, constexprs: dict, in_flight: bool) -> None:
    ttgir = m.compile(kernel, constexprs, {"num_warps": 4, "num_stages": 3}).asm["ttgir"]
    waits = [int(n) for n in re.findall(r"async_wait[^}]*num = ([0-9]+)", ttgir)]
    assert waits and (max(waits) > 0) == in_flight, (kernel, waits)


def _ptx_jobs(m: SimpleNamespace) -> list[Job]:
    jobs: list[Job] = [
        (f"matmul L2 prefetch before the PDL wait ({'fp8' if c['HAS_SCALES'] else 'bf16'})",
         lambda c=c: _check_prefetch(m, c))
        for c in (dict(HAS_SCALES=False, HAS_BIAS=False, SILU_MUL=False, NORM=True,
                       HAS_RESIDUAL=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1),
                  dict(HAS_SCALES=True, HAS_BIAS=False, SILU_MUL=False, NORM=False,
                       HAS_RESIDUAL=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8))]
    # The point of preload_table: with the block ids read before the loop, the pipeliner
    # keeps the next tile's copies in flight at each wait (num > 0); reading them in the loop,
    # each wait drains every copy. The prefill kernel reads a chunk's block ids before the
    # loop over its tiles, for the same reason.
    for name, kernel, constexprs, in_flight in (
            ("decode, preloaded table", m.td._decode_split_kernel,
             _decode(m, partition=1024, block_n=64, preload=True), True),
            ("decode, table read in the loop", m.td._decode_split_kernel,
             _decode(m, partition=1024, block_n=64), False),
            ("prefill", m.tp._prefill_kernel, _prefill(m), True)):
        jobs.append((f"pipelining: {name}", lambda k=kernel, c=constexprs, f=in_flight:
                     _check_pipelining(m, k, c, f)))
    return jobs


def build_jobs() -> list[Job]:
    """Every check, in a fixed order (each shard takes every SHARDS-th)."""
    m = _modules()
    kernels = kernel_table(m)
    return _compile_jobs(m, kernels) + _pdl_jobs(m, kernels) + _ptx_jobs(m)


if __name__ == "__main__":
    all_jobs = build_jobs()
    print(f"checks {len(all_jobs)}", flush=True)  # first: the test's time limit counts them
    sys.exit(1 if run_shard(all_jobs, int(sys.argv[1]), int(sys.argv[2])) else 0)
