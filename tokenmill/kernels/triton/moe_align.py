"""A step's (token, expert) pairs grouped by expert and each group padded to the fused-MoE
kernel's tile rows (vLLM's ``moe_align_block_size``), so that every row tile of
:mod:`tokenmill.kernels.triton.fused_moe` belongs to one expert.

Two ways to the same result: one Triton program for a step of up to
:data:`KERNEL_MAX_PAIRS` pairs (a decode step: one launch a layer, where the PyTorch ops are
~25 small kernels, ~1,200 a 48-layer step, as many as the step's other kernels together),
PyTorch ops for bigger steps (a prefill, whose products dwarf them). Both have fixed output
shapes and read nothing back to the host, so a CUDA graph can capture them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.pdl import launch_options, pdl_start

# The one-program grouping holds a step's pairs (sorted in registers) and a counter an
# expert; beyond these, PyTorch ops group them.
KERNEL_MAX_PAIRS = 1024
KERNEL_MAX_EXPERTS = 1023
_FILL = 1024


@dataclass(frozen=True)
class ExpertBlocks:
    """A step's (token, expert) pairs grouped by expert, each group padded to ``block_m``.

    A pair is its index in the flattened ``topk_ids`` (``token * k + slot``). ``sorted_ids``
    holds the pairs of expert 0, then of expert 1, ..., each group in token order and followed
    by the padding value ``pairs`` up to a multiple of ``block_m``, and more padding to the
    tensor's fixed length; ``expert_ids`` holds each block's expert (the last expert for the
    blocks past the total, which the kernel skips); ``total`` (one element, on the device) is
    the length in use. Fixed lengths: no value is read back to the host."""

    sorted_ids: torch.Tensor  # [capacity] int32
    expert_ids: torch.Tensor  # [capacity // block_m] int32
    total: torch.Tensor  # [1] int32
    pairs: int
    block_m: int


def block_capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """The most padded pairs a step can have: each expert that is chosen at all (at most
    ``min(E, pairs)`` of them) pads by fewer than ``block_m``; a multiple of ``block_m``."""
    most = pairs + min(num_experts, pairs) * (block_m - 1)
    return triton.cdiv(most, block_m) * block_m


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    in_kernel: bool | None = None) -> ExpertBlocks:
    """The pairs of ``topk_ids`` ``[T, k]`` (each in ``[0, num_experts)``) grouped by expert
    and padded to ``block_m`` (:class:`ExpertBlocks`). ``in_kernel``: one Triton program
    (True) or PyTorch ops (False); None: the program where the step fits it."""
    if in_kernel is None:
        in_kernel = (topk_ids.numel() <= KERNEL_MAX_PAIRS
                     and num_experts <= KERNEL_MAX_EXPERTS)
    if in_kernel:
        return _align_in_kernel(topk_ids, num_experts, block_m)
    return _align_in_torch(topk_ids, num_experts, block_m)


def _align_in_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    # Stable: an expert's pairs keep their token order, as the kernel's sort keeps it.
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[by_expert]
    capacity = block_capacity(pairs, num_experts, block_m)
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_ids[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    # A block's expert: the first whose padded group ends after the block's start.
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32),
                        pairs, block_m)


@triton.jit
def _align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr, starts_ptr, firsts_ptr,
                  pairs, num_experts, capacity, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_E: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr = False):
    """One program: each expert's pairs counted, the groups' padded starts summed, the
    outputs filled with padding, then the pairs sorted by (expert, pair) and each written at
    its group's start plus its rank in the group; a group's every ``BLOCK_M``-th pair writes
    its block's expert. ``starts`` and ``firsts`` (``[BLOCK_E]`` int32) are scratch."""
    pdl_start(PDL)
    p = tl.arange(0, BLOCK_P)
    # Padding lanes count in the bin num_experts, which no group uses.
    ids = tl.load(ids_ptr + p, mask=p < pairs, other=num_experts).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    counts = tl.where(e < num_experts, tl.histogram(ids, BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(starts_ptr + e, tl.cumsum(padded, 0) - padded)
    tl.store(firsts_ptr + e, tl.cumsum(counts, 0) - counts)
    tl.store(total_ptr, tl.sum(padded, 0))
    for i in range(0, capacity, FILL):
        offs = i + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + offs, tl.full([FILL], 0, tl.int32) + pairs,
                 mask=offs < capacity)
        tl.store(expert_ids_ptr + offs, tl.full([FILL], 0, tl.int32) + num_experts - 1,
                 mask=offs * BLOCK_M < capacity)
    # The scratch and the padding written by every thread before any thread reads or
    # overwrites them (a block-wide barrier orders global memory within the program).
    tl.debug_barrier()
    keys = tl.sort(ids * BLOCK_P + p)
    expert = keys // BLOCK_P
    ok = expert < num_experts
    rank = p - tl.load(firsts_ptr + expert, mask=ok, other=0)
    dest = tl.load(starts_ptr + expert, mask=ok, other=0) + rank
    tl.store(sorted_ids_ptr + dest, keys % BLOCK_P, mask=ok)
    tl.store(expert_ids_ptr + dest // BLOCK_M, expert, mask=ok & (rank % BLOCK_M == 0))


def _align_in_kernel(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    flat = topk_ids.reshape(-1).contiguous()
    pairs, device = flat.numel(), flat.device
    if pairs > KERNEL_MAX_PAIRS or num_experts > KERNEL_MAX_EXPERTS:
        raise ValueError(f"the grouping kernel takes up to {KERNEL_MAX_PAIRS} pairs and "
                         f"{KERNEL_MAX_EXPERTS} experts, got {pairs} and {num_experts}")
    capacity = block_capacity(pairs, num_experts, block_m)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts + 1)
    scratch = torch.empty(2, block_e, dtype=torch.int32, device=device)
    if pairs:
        _align_kernel[(1,)](flat, sorted_ids, expert_ids, total, scratch[0], scratch[1], pairs,
                            num_experts, capacity, BLOCK_M=block_m,
                            BLOCK_P=max(16, triton.next_power_of_2(pairs)), BLOCK_E=block_e,
                            FILL=_FILL, num_warps=4, **launch_options(device))
    else:
        total.zero_()
    return ExpertBlocks(sorted_ids, expert_ids, total, pairs, block_m)
