"""The mixture-of-experts layer on CUDA in Triton kernels (the fused-MoE design of vLLM and
SGLang): every (token, expert) pair of a step, grouped by expert, through the experts' gated
MLPs in one launch a projection.

A MoE layer gives each token ``k`` of ``E`` experts. Looping over the experts in PyTorch is a
few kernels an expert (an index, two products, the activation, a scatter): ~500 launches a
layer for 128 experts, most of them for a handful of rows. Here the step's ``T * k`` pairs are
grouped by expert and each group is padded to a multiple of the tile's rows
(:mod:`tokenmill.kernels.triton.moe_align`: one more small launch at decode), so that every
row tile belongs to one expert. Then one launch computes every chosen expert's ``w13``
product, with ``silu(gate) * up`` computed in the kernel from its two accumulators (no
``[T * k, 2I]`` tensor is written), and one launch every ``w2`` product with the routing
weight multiplied in. The ``k`` products of a token are summed last, in fp32. Nothing is read
back to the host, so a step can run in a CUDA graph. Experts may also be int8 or e4m3 with a
scale a row (:func:`quantize_experts`), widened in the kernel as they are loaded.

The CUDA kernel set binds :func:`fused_moe` as ``Kernels.moe``
(tokenmill/models/kernel_binding.py). The tiles are untuned defaults (:func:`default_tile`);
the tests run the kernels in Triton's interpreter on CPU tensors against a loop over tokens
and experts, and on a GPU where one is lent (tests/gpu/test_fused_moe_cuda.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.attention import dot_precision
from tokenmill.kernels.triton.fused_ops import silu_mul_values
from tokenmill.kernels.triton.moe_align import ExpertBlocks, align_to_blocks
from tokenmill.kernels.triton.pdl import launch_options, pdl_start


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                     total_ptr, scale_ptr, N, K, pairs, row_tiles, stride_am, stride_be,
                     stride_bn, stride_cm, stride_se, TOP_K: tl.constexpr,
                     GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, PDL: tl.constexpr = False):
    """One program per ``[BLOCK_M, BLOCK_N]`` tile of ``c[pair] = a[pair // TOP_K] @
    b[expert].T``, a row tile's pairs all of one expert (``sorted_ids``, ``expert_ids``). Rows
    of padding hold ``pairs`` and are neither read nor written; row tiles past ``total``
    (the padded pairs of this step) return at once.

    GATED (the ``w13`` product): ``b[expert]`` is ``[2N, K]``, gate rows then up rows, and the
    program keeps an accumulator for each, storing ``silu(gate) * up``. MUL_WEIGHT (the ``w2``
    product): each row times its pair's routing weight. HAS_SCALE: b holds int8 or fp8
    weights, widened to a's dtype as they are loaded, and ``scale[expert]`` the scale of each
    of its rows (``[E, N]``, gated ``[E, 2N]``), which multiplies the row's accumulator.
    Programs run in groups of GROUP_M row tiles, which share their expert's columns of b
    through L2."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(row_tiles - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    if tile_m * BLOCK_M >= tl.load(total_ptr):
        return
    pair = tl.load(sorted_ids_ptr + tile_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < pairs
    expert = tl.load(expert_ids_ptr + tile_m).to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = (b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
              + ks[:, None])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # (unused unless GATED)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if HAS_SCALE:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            if HAS_SCALE:
                up = up.to(a.dtype)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_SCALE:
        scales = scale_ptr + expert * stride_se + cols
        acc = acc * tl.load(scales, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scales + N, mask=col_ok, other=0.0)[None, :]
    dtype = c_ptr.dtype.element_ty
    if GATED:
        # Rounded to the activations' dtype first, as the eager gate_up projection is.
        out = silu_mul_values(acc.to(dtype), acc_up.to(dtype), dtype)
    else:
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        out = acc.to(dtype)
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :], out,
             mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class MoeTile:
    """Both launches' tile: rows (also the padding of each expert's group of pairs), columns
    and depth, row tiles a group, warps and pipelining depth."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"group_m must be a positive integer, got {self.group_m!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be 1..8, got {self.num_stages!r}")


def default_tile(pairs: int, num_experts: int) -> MoeTile:
    """The tile for ``pairs`` (token, expert) pairs over ``num_experts`` experts (not tuned on
    a device yet). At a few pairs an expert, as in decode, a tile's rows are mostly padding
    and the step reads the chosen experts' weights: 16 rows waste the least. With many pairs
    an expert, a prefill's, bigger tiles reuse each loaded weight tile over more rows."""
    per_expert = pairs / max(num_experts, 1)
    if per_expert <= 16:
        return MoeTile(block_m=16, block_n=64, block_k=128, group_m=1, num_stages=4)
    if per_expert <= 128:
        return MoeTile(block_m=64, block_n=64, block_k=64, group_m=8)
    return MoeTile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8)


# The experts' quantized dtypes and each one's largest value a scale maps a row's peak onto.
QUANTIZED = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_experts(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of stacked expert weights ``w`` ``[E, N, K]`` for :func:`fused_moe`: a
    float32 scale a row (``[E, N]``: the row's largest magnitude over the dtype's largest
    value, 1 for a zero row) and ``q ~= w / scale`` in ``dtype`` (int8, rounded; or
    float8_e4m3fn), contiguous. One expert at a time, so the fp32 copy is one expert's."""
    if dtype not in QUANTIZED:
        raise ValueError(f"quantize_experts: dtype must be one of "
                         f"{', '.join(map(str, QUANTIZED))}, got {dtype}")
    top = QUANTIZED[dtype]
    q = torch.empty(w.shape, dtype=dtype, device=w.device)
    scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        rows = w[e].float()
        peak = rows.abs().amax(dim=-1)
        scale[e] = torch.where(peak > 0, peak / top, torch.ones_like(peak))
        rows = (rows / scale[e, :, None]).clamp_(-top, top)
        q[e] = rows.round_() if dtype == torch.int8 else rows
    return q, scale


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, quantized: bool) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe takes x [T, H], w13 [E, 2I, H] and w2 [E, H, I], got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)} and {tuple(w2.shape)}")
    tokens, hidden = x.shape
    experts, inter = w2.shape[0], w2.shape[2]
    if w13.shape != (experts, 2 * inter, hidden) or w2.shape[1] != hidden:
        raise ValueError(f"w13 must be [E, 2I, H] = [{experts}, {2 * inter}, {hidden}] for x "
                         f"{tuple(x.shape)} and w2 {tuple(w2.shape)}, got {tuple(w13.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.dtype not in (
            torch.int32, torch.int64) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids (int) and topk_weights must be [T, k] with T = {tokens}, "
                         f"got {tuple(topk_ids.shape)} {topk_ids.dtype} and "
                         f"{tuple(topk_weights.shape)}")
    if not 1 <= topk_ids.shape[1] <= experts:
        raise ValueError(f"top-k must be 1..{experts} (the experts), got {topk_ids.shape[1]}")
    if not quantized and not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"x, w13 and w2 must have one dtype, got {x.dtype}, {w13.dtype} "
                         f"and {w2.dtype} (quantized experts take w13_scale and w2_scale)")
    _check_contiguous(x=x, w13=w13, w2=w2)


def _check_quantized(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                     w2_scale: torch.Tensor) -> None:
    if w13.dtype != w2.dtype or w13.dtype not in QUANTIZED:
        raise ValueError(f"with scales, w13 and w2 must both be int8 or float8_e4m3fn, got "
                         f"{w13.dtype} and {w2.dtype}")
    for name, scale, w in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
        if scale.shape != w.shape[:2] or scale.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {list(w.shape[:2])} (a scale for each "
                             f"row), got {scale.dtype} {list(scale.shape)}")
    _check_contiguous(w13_scale=w13_scale, w2_scale=w2_scale)


def _check_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {tuple(t.stride())}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              tile: MoeTile | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' gated MLPs summed with their routing weights: for each token ``t``,
    ``sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)`` with ``e = topk_ids[t, j]`` and
    ``[g | u] = w13[e] @ x[t]`` (gate rows, then up rows). ``x`` ``[T, H]``, ``w13``
    ``[E, 2I, H]``, ``w2`` ``[E, H, I]`` in one dtype with contiguous last dimensions;
    ``topk_weights`` ``[T, k]`` (float32; taken as is), ``topk_ids`` ``[T, k]`` int64 or
    int32, each id in ``[0, E)`` (not checked: that would read them back to the host).
    Returns ``[T, H]`` in x's dtype. ``tile``: both launches' tile (default
    :func:`default_tile`).

    Quantized experts (:func:`quantize_experts`): ``w13`` and ``w2`` in int8 or e4m3 with
    ``w13_scale`` ``[E, 2I]`` and ``w2_scale`` ``[E, H]`` (float32, one a row), the weights
    widened to x's dtype in the kernel (weight-only: half the bytes of 16-bit experts)."""
    _check(x, w13, w2, topk_weights, topk_ids, quantized=w13_scale is not None)
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("fused_moe takes both w13_scale and w2_scale, or neither")
    if w13_scale is not None:
        _check_quantized(w13, w2, w13_scale, w2_scale)
    tokens, hidden = x.shape
    experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return x.new_empty(0, hidden)
    pairs = tokens * top_k
    tile = default_tile(pairs, experts) if tile is None else tile
    blocks = align_to_blocks(topk_ids, experts, tile.block_m)
    weights = topk_weights.to(torch.float32).contiguous()
    act = x.new_empty(pairs, inter)
    _launch(x, w13, w13_scale, act, weights, blocks, tile, top_k, gated=True)
    # Each pair's weighted output kept in fp32 and the k of a token summed in fp32, rounded
    # once (as the grouped PyTorch path, tokenmill.kernels.moe, sums them).
    out = x.new_empty(pairs, hidden, dtype=torch.float32)
    _launch(act, w2, w2_scale, out, weights, blocks, tile, 1, gated=False)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _launch(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None, c: torch.Tensor,
            weights: torch.Tensor, blocks: ExpertBlocks, tile: MoeTile, top_k: int,
            gated: bool) -> None:
    # c [pairs, N]; a's rows are tokens (top_k > 1: a row for each of a token's pairs) or
    # pairs; b [E, N, K] (gated: [E, 2N, K]), quantized where scale [E, N] (2N) is given.
    n, k = c.shape[1], b.shape[2]
    row_tiles = blocks.expert_ids.numel()
    grid = (row_tiles * triton.cdiv(n, tile.block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, weights, blocks.sorted_ids, blocks.expert_ids, blocks.total,
        c if scale is None else scale, n, k, blocks.pairs, row_tiles, a.stride(0),
        b.stride(0), b.stride(1), c.stride(0), 0 if scale is None else scale.stride(0),
        TOP_K=top_k, GATED=gated, MUL_WEIGHT=not gated, HAS_SCALE=scale is not None,
        DOT_PRECISION=dot_precision(a),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **launch_options(a.device))
