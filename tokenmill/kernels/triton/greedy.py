"""One Triton kernel for greedy decoding on CUDA: per row of logits, the argmax and its
log-probability, reading the logits once in their own dtype.

In PyTorch ops ``Sampler.greedy`` was ``logits.float()`` (a full fp32 copy of the bf16
logits), an argmax, then a gather and a logsumexp: several passes over a [B, vocab] tensor,
~0.3 ms of a batch-256 decode step of an 8B model with a 128,256-token vocabulary on an H200. Here each row
is read once: every lane of a block keeps its largest value, the first column holding it and
the sum of exp(x - that value), updated online with one exponential per element; the lanes
are merged at the end as a softmax over blocks merges them. The CPU has the same step in C++
(``csrc/greedy_sample.h``).

Which token, as torch.argmax on CUDA (ATen's ``GreaterOrNan``): the first index of the
largest value; a NaN is larger than everything, so the first NaN wins. The log-probability is
``logit[argmax] - logsumexp(row)`` in fp32, as ``sampler.logprobs_of`` gives: NaN for a row
holding a NaN or +inf, or all -inf (there PyTorch's is NaN too).

Rows are cut into parts unless there are many: at batch 1 one program would stream the
whole 128k-entry row through a single SM, and at batch 256 a program a row leaves the SMs
too little in flight. So each row is split into parts of at least ``_MIN_PART`` entries,
about ``_TARGET_PROGRAMS`` programs in all, scanned in parallel; a second small launch merges
each row's parts (the same merge as the lanes'). From ``_TARGET_PROGRAMS`` rows on (or for a
short vocabulary) a row is one program and one launch writes the results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.pdl import launch_options, pdl_start
from tokenmill.utils import cdiv

# Columns each program reads per loop iteration: 8 per thread of 8 warps, one 16-byte load
# of bf16 (fewer warps for a narrower block).
_BLOCK = 2048
# Programs to aim for: fewer rows than this split theirs. On an H200 (132 SMs) at a 128K
# vocab in bf16, 528 (4 a SM) took batch 256 from 47 us (a row a program) to 37 us and
# batch 64 from 18 to 12; 1,056 and more gained nothing (CUDA-graph timings, PyTorch's ops
# 395 us and 146 us).
_TARGET_PROGRAMS = 528
# The shortest part worth a program of its own (8 KiB of bf16): batch 1 took 4.4 us with
# it, 5.2 with 8,192 (PyTorch's ops: 69 us).
_MIN_PART = 4096
# Larger than any column index: the index of a lane or part that holds no column.
_NO_INDEX = tl.constexpr(2147483647)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _merge(best, best_idx, total):
    """Lanes (or parts) -> the row's (largest value, first index of it, sum of exp(x - it)).
    Each lane holds its largest value, the first column holding it and its own sum."""
    nan = best != best
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    m = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    top = tl.where(any_nan, nan, best == m)
    idx = tl.min(tl.where(top, best_idx, _NO_INDEX), axis=0)
    m = tl.where(any_nan, float("nan"), m)
    # Equal maxima (-inf ones included) weigh their sums 1: exp(-inf - -inf) would be NaN.
    scale = tl.where(best == m, 1.0, tl.exp(best - m))
    return m, idx, tl.sum(total * scale, axis=0)


@triton.jit
def _store_result(ids_ptr, lp_ptr, row, m, idx, total):
    tl.store(ids_ptr + row, idx.to(tl.int64))
    # logit[argmax] is m itself: m - m is 0, or NaN where m is NaN or infinite (as PyTorch).
    tl.store(lp_ptr + row, (m - m) - tl.log(total))


@triton.jit
def _greedy_scan_kernel(x_ptr, ids_ptr, lp_ptr, part_max_ptr, part_sum_ptr, part_idx_ptr,
                        n_cols, stride_x, part_len, BLOCK: tl.constexpr, FINAL: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    start = part * part_len
    end = tl.minimum(start + part_len, n_cols)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    # A lane that only ever sees -inf answers its first column (torch's for an all -inf row).
    best_idx = start + lanes
    total = tl.zeros([BLOCK], tl.float32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + lanes
        x = tl.load(x_row + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        # Strictly larger only, so a lane keeps the first column of its maximum; NaN wins.
        wins = (x > best) | ((x != x) & (best == best))
        # One exponential: a new maximum rescales the sum by exp(-d) and adds 1, anything
        # else adds exp(d). Equal values (-inf ones included) add 1 instead of exp(NaN).
        d = tl.where(x == best, 0.0, x - best)
        e = tl.exp(-tl.abs(d))
        total = tl.where(d > 0, total * e + 1.0, total + e)
        best_idx = tl.where(wins, cols, best_idx)
        best = tl.where(wins, x, best)
    m, idx, s = _merge(best, best_idx, total)
    if FINAL:
        _store_result(ids_ptr, lp_ptr, row, m, idx, s)
    else:
        at = row * tl.num_programs(1) + part
        tl.store(part_max_ptr + at, m)
        tl.store(part_sum_ptr + at, s)
        tl.store(part_idx_ptr + at, idx)


@triton.jit
def _greedy_combine_kernel(part_max_ptr, part_sum_ptr, part_idx_ptr, ids_ptr, lp_ptr,
                           n_parts, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    mask = p < n_parts
    at = row * n_parts + p
    best = tl.load(part_max_ptr + at, mask=mask, other=float("-inf"))
    best_idx = tl.load(part_idx_ptr + at, mask=mask, other=_NO_INDEX)
    total = tl.load(part_sum_ptr + at, mask=mask, other=0.0)
    m, idx, s = _merge(best, best_idx, total)
    _store_result(ids_ptr, lp_ptr, row, m, idx, s)


def _num_parts(rows: int, cols: int) -> int:
    return max(1, min(_TARGET_PROGRAMS // rows, cdiv(cols, _MIN_PART)))


def greedy_with_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N] int64, logprobs [N] fp32)`` for ``logits`` [N, V] (fp32, fp16 or bf16, last
    dimension contiguous): each row's ``argmax`` (ties and NaN as torch.argmax) and
    ``logit[id] - logsumexp(row)``, computed in fp32 from one read of the logits."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in _DTYPES:
        raise ValueError(f"greedy_with_logprobs takes 2-D float32/float16/bfloat16 logits "
                         f"with a contiguous last dimension, got {logits.dtype} of shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    rows, cols = logits.shape
    if cols == 0:
        raise ValueError("greedy_with_logprobs needs at least one column (vocab size 0)")
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    lps = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return ids, lps
    block = min(_BLOCK, triton.next_power_of_2(cols))
    part_len = cdiv(cdiv(cols, _num_parts(rows, cols)), block) * block
    parts = cdiv(cols, part_len)
    if parts == 1:  # the parts' buffers go unused: no allocations for them
        part_max, part_sum, part_idx = lps, lps, ids
    else:
        part_max, part_sum = torch.empty(2, rows, parts, dtype=torch.float32,
                                         device=logits.device)
        part_idx = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    _greedy_scan_kernel[(rows, parts)](logits, ids, lps, part_max, part_sum, part_idx, cols,
                                       logits.stride(0), part_len, BLOCK=block,
                                       FINAL=parts == 1, num_warps=min(8, max(1, block // 256)),
                                       **launch_options(logits.device))
    if parts > 1:
        _greedy_combine_kernel[(rows,)](part_max, part_sum, part_idx, ids, lps, parts,
                                        BLOCK_P=triton.next_power_of_2(parts), num_warps=1,
                                        **launch_options(part_max.device))
    return ids, lps
