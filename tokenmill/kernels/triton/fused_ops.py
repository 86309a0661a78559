"""Fused elementwise kernels for CUDA: add + RMSNorm, per-head RMSNorm, SiLU-and-mul, rotary.

A decode step of a large model at small batch is bound by reading the weights; everything else
should cost nothing. In eager PyTorch each of these is several kernels (an RMSNorm in bf16 is an
upcast, the norm, a downcast and a scale; the residual add one more), each a full round trip
through device memory and, even inside a CUDA graph, a few microseconds of its own: ~10 of them
per layer add up to milliseconds per token on an 8B model. Each function here is one Triton
kernel with the same arithmetic as the PyTorch code in ``models/layers.py`` (fp32 inside).

Where an fp8 linear reads the output (``quant.fp8.Fp8Linear``), the norm and SiLU-and-mul
kernels can also quantize it per row to e4m3 on the way out (``rms_norm_fp8``,
``silu_and_mul_fp8``): the same bytes and scales as the unfused output quantized by
``kernels/triton/fp8.py``, whose kernel shares the arithmetic here (``fp8_scale``,
``fp8_quantize``, and ``quantize_row``, which the SiLU-and-mul kernel runs over its products
and that one over loaded values), one kernel and one round trip less per linear.

The model's blocks are bound to them once, when a model is built for CUDA
(``tokenmill.models.kernel_binding``, which imports this module only then); the tests run them in Triton's interpreter on the CPU against the PyTorch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8_activation import FP8_MAX, QuantizedActivation
from tokenmill.kernels.triton.attention import rope_factors, rotated_halves
from tokenmill.kernels.triton.pdl import launch_options, pdl_start

# Row quantization for fp8 (the SiLU-and-mul kernel here, quant/fp8_kernels.py's): a row of
# up to this many elements is held in registers, and read once; a longer one is read in
# blocks of _FP8_BLOCK, twice (the absmax, then the quantization, mostly from L2).
_FP8_ONE_PASS_MAX = 16384
_FP8_BLOCK = 2048


def fp8_row_launch(n_cols: int) -> tuple[int, int, bool]:
    """``(BLOCK, num_warps, ONE_PASS)`` of a row-quantizing kernel over ``n_cols`` columns:
    one pass over the whole row when it fits (a warp per 1,024 elements, 4 to 16 of them: 32
    values a thread at most), else two passes in blocks of 2,048 at 4 warps."""
    block = triton.next_power_of_2(max(n_cols, 1))
    if block <= _FP8_ONE_PASS_MAX:
        return block, min(16, max(4, block // 1024)), True
    return _FP8_BLOCK, 4, False


@triton.jit
def fp8_scale(peak, fp8_max):
    """The per-row scale that maps the row's largest magnitude ``peak`` onto ``fp8_max`` (1 for
    an all-zero row), as ``packing.scale_rows_absmax`` computes it (IEEE division)."""
    return tl.where(peak > 0, tl.math.div_rn(peak, fp8_max), 1.0)


@triton.jit
def fp8_quantize(x, scale, fp8_max):
    """fp32 ``x / scale`` clamped to +-``fp8_max``, ready for the cast to e4m3."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)


@triton.jit
def rms_normalized(x, n_cols, eps, dtype: tl.constexpr, AXIS: tl.constexpr):
    """fp32 ``x`` RMS-normalized along ``AXIS`` (``n_cols`` long, masked entries 0) and rounded
    to ``dtype``, back in fp32: the caller scales it by the weight and rounds again, as
    ``layers.RMSNorm`` (and HF) compute low-precision activations. (The weight is loaded
    after this: loaded before, it stays live through the sum, 64 registers instead of 48.)"""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=AXIS) / n_cols + eps)
    if AXIS == 1:  # a 2-D block's rows
        inv = inv[:, None]
    return (x * inv).to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, scale_ptr, n_cols, eps,
                     fp8_max, stride_x, stride_res, stride_res_out, stride_out,
                     HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    """One program per row: (s = x + residual, written out), out = norm(s or x) * w; with
    FP8_OUT, out quantized to e4m3 with the row's scale (written to scale_ptr)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty  # the activations' (out's too, unless FP8_OUT)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the activations' dtype first, as the eager add does.
        x = (x + r).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        x = x.to(tl.float32)
    y = rms_normalized(x, n_cols, eps, dtype, 0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (y * w).to(dtype)
    if FP8_OUT:
        # The rounded output, quantized as quant/fp8_kernels.py quantizes it (masked columns
        # are 0 and leave the absmax alone).
        y32 = y.to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(y32), axis=0), fp8_max)
        tl.store(scale_ptr + row, scale)
        # Triton gives the whole kernel the widest vector any of its memory accesses takes:
        # 16 one-byte values would change the layout, and with it the order tl.sum adds the
        # squares in. Capped at the 16 bytes of the activations' own accesses, the layout and
        # so the norm stay the unfused kernel's, bit for bit.
        vec: tl.constexpr = 128 // dtype.primitive_bitwidth
        qcols = tl.max_contiguous(tl.arange(0, BLOCK), vec)
        tl.store(out_ptr + row * stride_out + qcols,
                 fp8_quantize(y32, scale, fp8_max).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


@triton.jit
def silu_mul_values(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` in ``dtype``, the activations': silu rounded to it before the
    product, as eager does (the matmul's SiLU prologue computes the same)."""
    gate = gate.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_mul(x_row, cols, mask, n_cols):
    """``silu(gate) * up`` at ``cols`` of the row of gate (then up) halves at ``x_row``."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0)
    return silu_mul_values(gate, up, x_row.dtype.element_ty)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, column block): out = silu(gate) * up, gate and up halves of x."""
    pdl_start(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    out = _silu_mul(x_ptr + row * stride_x, cols, mask, n_cols)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def quantize_row(x_row, out_row, scale_ptr, n_cols, fp8_max, VALUES: tl.constexpr,
                 BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """The row of ``VALUES(x_row, cols, mask, n_cols)`` (a Triton function: a load, or a
    product computed from loads) quantized to e4m3 at ``out_row`` with the row's scale, written
    to ``scale_ptr``. The absmax must be known before the first value is written: with
    ONE_PASS (BLOCK covers the row) the values stay in registers; otherwise they are produced
    twice, the second time from L2 (same bits)."""
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = VALUES(x_row, cols, mask, n_cols).to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(x), axis=0), fp8_max)
        tl.store(scale_ptr, scale)
        tl.store(out_row + cols, fp8_quantize(x, scale, fp8_max).to(out_row.dtype.element_ty),
                 mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            x = VALUES(x_row, cols, cols < n_cols, n_cols).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = fp8_scale(tl.max(amax, axis=0), fp8_max)
        tl.store(scale_ptr, scale)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = VALUES(x_row, cols, mask, n_cols).to(tl.float32)
            tl.store(out_row + cols,
                     fp8_quantize(x, scale, fp8_max).to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, out_ptr, scale_ptr, n_cols, stride_x, stride_out, fp8_max,
                             BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                             PDL: tl.constexpr = False):
    """One program per row: silu(gate) * up as _silu_and_mul_kernel computes it, quantized to
    e4m3 with the row's scale (:func:`quantize_row`)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    quantize_row(x_ptr + row * stride_x, out_ptr + row * stride_out, scale_ptr + row, n_cols,
                 fp8_max, _silu_mul, BLOCK, ONE_PASS)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st,
                   NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """One program per token: rotate every head of x in place (rotate-half layout) by the
    token's cos and sign-folded sin rows (``RotaryEmbedding.cos_sin``'s)."""
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    cos, sin = rope_factors(cos_ptr + t * stride_ct, sin_ptr + t * stride_st, d, d < HALF, HALF)
    base = x_ptr + t * stride_xt + h * stride_xh + d
    x1, x2 = rotated_halves(base, mask, cos, sin, HALF)
    tl.store(base, x1, mask=mask)
    tl.store(base + HALF, x2, mask=mask)


@triton.jit
def _head_rms_norm_kernel(x_ptr, wq_ptr, wk_ptr, stride_xt, stride_xh, eps,
                          NUM_Q: tl.constexpr, NUM_HEADS: tl.constexpr, DIM: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """One program per token: each of its heads RMS-normed in place over the head dimension,
    the first NUM_Q (the queries) scaled by wq, the others (the keys) by wk."""
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < DIM
    mask = (h < NUM_HEADS) & dmask
    ptrs = x_ptr + t * stride_xt + h * stride_xh + d
    dtype = x_ptr.dtype.element_ty
    y = rms_normalized(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), DIM, eps, dtype, 1)
    wq = tl.load(wq_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y * tl.where(h < NUM_Q, wq, wk)).to(dtype), mask=mask)


def _launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None, out: torch.Tensor,
                     scale: torch.Tensor | None) -> torch.Tensor:
    """Run the norm kernel into ``out`` (and, fp8, ``scale``); returns ``s``."""
    rows, cols = x.shape
    res = x if residual is None else residual
    res_out = x if residual is None else torch.empty_like(x)
    _rms_norm_kernel[(rows,)](
        x, res, res_out, weight, out, out if scale is None else scale, cols, eps, FP8_MAX,
        x.stride(0), res.stride(0), res_out.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, FP8_OUT=scale is not None,
        BLOCK=triton.next_power_of_2(cols), **launch_options(x.device))
    return res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(s) * weight, s)`` over the last dimension of a 2-D ``x``, where ``s`` is
    ``x + residual`` (a new tensor) or, without a residual, ``x`` itself."""
    out = torch.empty_like(x)
    return out, _launch_rms_norm(x, weight, eps, residual, out, None)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float8_e4m3fn,
                 ) -> tuple[QuantizedActivation, torch.Tensor]:
    """:func:`rms_norm` with the output quantized per row for an fp8 linear, in the kernel.

    ``out_dtype`` is for the tests: Triton's interpreter casts to e4m3 wrongly, so there
    they read the clamped values before the cast (fp32)."""
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=out_dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    res_out = _launch_rms_norm(x, weight, eps, residual, out, scale)
    return QuantizedActivation(out, scale, x.dtype), res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` of ``2n`` columns (the fused gate/up output)."""
    rows, two_n = x.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0),
                                                        BLOCK=block, **launch_options(x.device))
    return out


def silu_and_mul_fp8(x: torch.Tensor, out_dtype: torch.dtype = torch.float8_e4m3fn,
                     ) -> QuantizedActivation:
    """:func:`silu_and_mul` quantized per row for an fp8 linear, in the kernel
    (``out_dtype`` as in :func:`rms_norm_fp8`)."""
    rows, two_n = x.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block, warps, one_pass = fp8_row_launch(n)
        _silu_and_mul_fp8_kernel[(rows,)](x, out, scale, n, x.stride(0), out.stride(0), FP8_MAX,
                                          BLOCK=block, ONE_PASS=one_pass, num_warps=warps,
                                          **launch_options(x.device))
    return QuantizedActivation(out, scale, x.dtype)


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
                              BLOCK_D=triton.next_power_of_2(half), **launch_options(x.device))
    return x


def head_rms_norm_(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                   num_q_heads: int, eps: float) -> torch.Tensor:
    """A per-head RMSNorm of q and k in place, one kernel: ``qk`` ``[T, Hq + Hk, D]``
    holds the queries' heads then the keys'; each head is normed as :class:`layers.RMSNorm`
    norms it, with ``q_weight`` for the first ``num_q_heads`` and ``k_weight`` for the rest.
    ``qk`` may be a strided view (the q and k columns of the fused projection) whose head
    dimension is contiguous. Eager, the two norms and the concatenation took ~10 kernels."""
    tokens, heads, dim = qk.shape
    if qk.stride(2) != 1:
        raise ValueError("head_rms_norm_ needs the head dimension to be contiguous")
    if not 0 <= num_q_heads <= heads or q_weight.shape != (dim,) or k_weight.shape != (dim,):
        raise ValueError(f"head_rms_norm_: {num_q_heads} query heads of {heads}, weights "
                         f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)} for head dim {dim}")
    if tokens:
        block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
        # A warp per 1,024 values of the token's heads (32 a thread), 4 to 16 of them: a common
        # 64 + 8 heads of 128 would otherwise hold 128 fp32 values a thread.
        _head_rms_norm_kernel[(tokens,)](qk, q_weight, k_weight, qk.stride(0), qk.stride(1), eps,
                                         NUM_Q=num_q_heads, NUM_HEADS=heads, DIM=dim,
                                         BLOCK_H=block_h, BLOCK_D=block_d,
                                         num_warps=min(16, max(4, block_h * block_d // 1024)),
                                         **launch_options(qk.device))
    return qk
