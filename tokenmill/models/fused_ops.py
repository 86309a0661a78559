"""Fused elementwise kernels for CUDA: residual add + RMSNorm, SiLU-and-mul, rotary embedding.

A decode step of a large model at small batch is bound by reading the weights; everything else
should cost nothing. In eager PyTorch each of these is several kernels (an RMSNorm in bf16 is an
upcast, the norm, a downcast and a scale; the residual add one more), each a full round trip
through device memory and, even inside a CUDA graph, a few microseconds of its own: ~10 of them
per layer add up to milliseconds per token on an 8B model. Each function here is one Triton
kernel with the same arithmetic as the PyTorch code in ``models/layers.py`` (fp32 inside).

The layers call them for CUDA tensors only (``layers.cuda_kernels``, which imports this module
on first use); the tests run them in Triton's interpreter on the CPU against the PyTorch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, n_cols, eps,
                     stride_x, stride_res, stride_res_out, stride_out,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: (s = x + residual, written out), out = norm(s or x) * w."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the activations' dtype first, as the eager add does.
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = x * (1.0 / tl.sqrt(var + eps))
    # Low-precision activations: normalized in fp32, rounded, then scaled (as HF does).
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (y * w).to(out_ptr.dtype.element_ty),
             mask=mask)

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out,
                         BLOCK: tl.constexpr):
    """Program (row, column block): out = silu(gate) * up, gate and up halves of x."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    # silu rounded to the activations' dtype before the product, as eager does.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st,
                   NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """One program per token: rotate every head of x in place (rotate-half layout) by the
    token's cos and sign-folded sin rows (``RotaryEmbedding.cos_sin``'s)."""
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)
    # The table's first half holds -sin, its second half +sin: read the second.
    sin = tl.load(sin_ptr + t * stride_st + HALF + d, mask=d < HALF, other=0.0)
    sin = sin.to(tl.float32)
    base = x_ptr + t * stride_xt + h * stride_xh + d
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(s) * weight, s)`` over the last dimension of a 2-D ``x``, where ``s`` is
    ``x + residual`` (a new tensor) or, without a residual, ``x`` itself."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res = x if residual is None else residual
    res_out = x if residual is None else torch.empty_like(x)
    _rms_norm_kernel[(rows,)](
        x, res, res_out, weight, out, cols, eps, x.stride(0), res.stride(0), res_out.stride(0),
        out.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` of ``2n`` columns (the fused gate/up output)."""
    rows, two_n = x.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0),
                                                        BLOCK=block)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`tokenmill.models.layers.apply_rotary` in place: rotate ``x`` ``[T, H, D]`` by the
    step's ``[T, 1, D]`` cos and sign-folded sin. ``x`` may be a strided view (the q/k columns
    of the fused projection) whose head dimension is contiguous."""
    tokens, heads, dim = x.shape
    if x.stride(2) != 1:
        raise ValueError("rotary_ needs the head dimension to be contiguous")
    half = dim // 2
    _rotary_kernel[(tokens,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                              sin.stride(0), NUM_HEADS=heads, HALF=half,
                              BLOCK_H=triton.next_power_of_2(heads),
                              BLOCK_D=triton.next_power_of_2(half))
    return x
