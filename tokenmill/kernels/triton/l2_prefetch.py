"""The L2 prefetch's read: a Triton kernel that pulls the first bytes of a weight into the GPU's
L2 cache (tokenmill/runner/l2_prefetch.py decides which weights and when).

The read's programs sum their slices into one float each, so that the compiler keeps the loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The read's programs: four an SM of an H100/H200 (132 SMs), each with a block of 4,096
# values (8 KB in bf16) in flight, ~32 KB an SM (48 registers, 10 programs an SM fit: compiled
# for sm_90 under Triton 3.6).
NUM_PROGRAMS = 528
BLOCK = 4096


@triton.jit(do_not_specialize=["n", "iters"])
def _touch_kernel(x_ptr, out_ptr, n, iters, BLOCK: tl.constexpr):
    """Program p sums blocks p, p + P, p + 2P, ... of ``x[:n]`` (P programs, ``iters`` blocks
    each) into ``out[p]``. Sizes are runtime arguments: one compiled kernel serves every
    weight (a compile inside a graph's capture would fail)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(iters):
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0,
                       eviction_policy="evict_last").to(tl.float32)
        offs += step
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def touch_prefix(weight: torch.Tensor, max_bytes: int, out: torch.Tensor) -> None:
    """Read the first ``max_bytes`` of ``weight`` (all of it if smaller), each program's sum
    into ``out`` (``NUM_PROGRAMS`` floats)."""
    flat = weight.reshape(-1)
    n = min(flat.numel(), max_bytes // flat.element_size())
    if n == 0:
        return
    iters = triton.cdiv(n, NUM_PROGRAMS * BLOCK)
    _touch_kernel[(NUM_PROGRAMS,)](flat, out, n, iters, BLOCK=BLOCK, num_warps=4)
