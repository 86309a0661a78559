"""One Triton kernel for the activation side of an fp8 matmul on CUDA: each row's absmax
scale and the row scaled, clamped and cast to e4m3, in one pass over memory (two for rows of
more than 16,384 columns).

``Fp8Linear`` quantizes its input per token before every ``torch._scaled_mm``. In PyTorch
ops that is ten kernels (upcast, abs, amax, the scale's compare / divide / where, divide,
clamp, cast); at batch 1 on an H200 the fp8 8B dense shape (hidden 4,096, 32 layers) decoded at 127.9 tok/s against
bf16's 178.2 (benchmarks/results/gpu), with 1,280 of those small kernels a step. This is the
same arithmetic as ``packing.scale_rows_absmax`` followed by the clamp and cast (fp32 inside,
IEEE division), so both paths give the same bytes. ``Fp8Linear`` calls it for CUDA tensors
only; the tests run it in Triton's interpreter against the PyTorch ops.

The row's quantization is ``fused_ops.quantize_row``, which the SiLU-and-mul kernel also runs
(over its products instead of loaded values), and whose scale and rounding the norm kernel
shares, to write e4m3 for an fp8 linear directly: inputs quantized there skip this kernel,
with the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fused_ops import fp8_row_launch, quantize_row
from tokenmill.kernels.triton.pdl import launch_options, pdl_start


@triton.jit
def _load_row(x_row, cols, mask, n_cols):
    return tl.load(x_row + cols, mask=mask, other=0.0)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n_cols, stride_x, stride_q, max_value,
                          BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr = False):
    """One program per row (``fused_ops.quantize_row`` of the loaded row)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    quantize_row(x_ptr + row * stride_x, q_ptr + row * stride_q, scale_ptr + row, n_cols,
                 max_value, _load_row, BLOCK, ONE_PASS)


def quantize_rows_fp8(x: torch.Tensor, max_value: float,
                      dtype: torch.dtype = torch.float8_e4m3fn,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] in dtype, scale [N, 1] fp32)`` with ``q ~= x / scale`` per row: the row's
    largest magnitude maps onto ``max_value`` (scale 1 for an all-zero row), values are
    clamped to +-``max_value`` before the cast. ``x`` is 2-D with a contiguous last dim."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fp8 takes a 2-D tensor with a contiguous last "
                         f"dimension, got shape {tuple(x.shape)} strides {x.stride()}")
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block, warps, one_pass = fp8_row_launch(cols)
        _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0),
                                       float(max_value), BLOCK=block, ONE_PASS=one_pass,
                                       num_warps=warps, **launch_options(x.device))
    return q, scale
