"""fp8 (e4m3) linear layers: weights per output channel, activations per token, one
``torch._scaled_mm`` (Hopper/Ada GPUs, and the CPU), or on a GPU whose tuning picks it for a
shape, the Triton kernel of ``models/triton_gemm.py``. On CUDA the activations are quantized by one
Triton kernel (``fp8_kernels.py``), unless the kernel that produced them already did
(``models.fp8_activation``); elsewhere by the same arithmetic in PyTorch ops."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.fp8_activation import FP8_MAX, QuantizedActivation
from tokenmill.models.linear import gemm_tile
from tokenmill.quant.packing import KERNEL_DTYPE, QUANTIZE_ROWS, scale_rows_absmax
from tokenmill.utils import triton_module

# _scaled_mm wants both matrix dimensions of the weight to be multiples of this.
FP8_DIM_MULTIPLE = 16


def fp8_supported(device: torch.device) -> bool:
    """``torch._scaled_mm`` in e4m3 with per-row scales runs on CUDA GPUs of compute
    capability 8.9 or newer (Ada, Hopper, Blackwell), and on the CPU where this torch's CPU
    kernel takes per-row scales (2.13 does; 2.11's takes one scale a tensor only)."""
    if device.type == "cpu":
        return _cpu_takes_row_scales()
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_unsupported_reason(device: torch.device) -> str:
    """Why :func:`fp8_supported` is False for ``device``, in words for an error message."""
    if device.type == "cpu":
        return (f"this torch's ({torch.__version__}) CPU _scaled_mm does not take per-row "
                "scales (torch 2.13 does)")
    return (f"fp8 matmuls need a GPU of compute capability 8.9+ (Ada, Hopper) or the CPU; "
            f"{device} has none")


@functools.cache
def _cpu_takes_row_scales() -> bool:
    """One 16 x 16 product with per-row and per-column scales on the CPU: whether it runs."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 weight [N, K], fp32 scales [N])`` with ``w ~= q * scales`` per output row."""
    qs, scales = [], []
    for rows in weight.detach().split(QUANTIZE_ROWS):
        scaled, s = scale_rows_absmax(rows, FP8_MAX)
        qs.append(scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        scales.append(s.view(-1))
    return torch.cat(qs), torch.cat(scales)


def quantize_activation(x: torch.Tensor) -> QuantizedActivation:
    """Rows of a 2-D ``x`` scaled onto e4m3 per row: one kernel on CUDA, PyTorch ops
    elsewhere, the same bytes either way."""
    return activation_quantizer(x.device)(x)


def torch_quantize_activation(x: torch.Tensor) -> QuantizedActivation:
    """:func:`quantize_activation` in PyTorch ops (about ten kernels)."""
    scaled, scale = scale_rows_absmax(x, FP8_MAX)
    xq = scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedActivation(xq, scale, x.dtype)


def _triton_quantize_activation(kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                                x: torch.Tensor) -> QuantizedActivation:
    xq, scale = kernel(x.contiguous(), FP8_MAX)  # one kernel, not ten
    return QuantizedActivation(xq, scale, x.dtype)


def activation_quantizer(device: torch.device | str, triton: bool | None = None
                         ) -> Callable[[torch.Tensor], QuantizedActivation]:
    """The activation quantization for tensors on ``device``: the Triton kernel on CUDA
    where Triton is installed (``triton`` True: wherever it is installed, for the tests'
    interpreter), else PyTorch's ops."""
    use = torch.device(device).type == "cuda" if triton is None else triton
    kernels = triton_module("tokenmill.kernels.triton.fp8") if use else None
    if kernels is None:
        return torch_quantize_activation
    return functools.partial(_triton_quantize_activation, kernels.quantize_rows_fp8)


class Fp8Linear(nn.Module):
    """``y = x @ w.T + bias`` in fp8 (e4m3): weights per output channel, activations per token.

    Each call scales every token's activations onto e4m3's range (unless they come as a
    :class:`QuantizedActivation`, quantized by the kernel that produced them), then one
    ``torch._scaled_mm`` multiplies both in fp8 and applies the two scale vectors (row-wise
    scaling) into a bf16 result. On an H100 that halves the weight bytes each decode step
    reads, and doubles the tensor-core rate of prefill, against bf16.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        # [1, N] so that _scaled_mm reads it as one scale per output column.
        self.register_buffer("weight_scale", weight_scale.float().reshape(1, -1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # The activations' quantization, chosen once for the weight's device (use_kernels).
        self._quantize = activation_quantizer(weight.device)

    def use_kernels(self, kernels: Any) -> None:
        """Quantize the activations with the Triton kernel where ``kernels`` (a model's
        ``kernel_binding.Kernels``) are the Triton set, else with PyTorch's ops."""
        self._quantize = activation_quantizer(self.weight.device,
                                              triton=kernels.name == "triton")

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
        n, k = weight.shape
        if n % FP8_DIM_MULTIPLE or k % FP8_DIM_MULTIPLE:
            raise ValueError(f"fp8 needs both weight dimensions to be multiples of "
                             f"{FP8_DIM_MULTIPLE}, got [{n}, {k}]")
        if not fp8_supported(weight.device):
            raise ValueError(fp8_unsupported_reason(weight.device))
        q, scales = quantize_fp8(weight)
        return cls(q, scales, bias)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            return self._scaled_mm(x)
        y = self._scaled_mm(self._quantize(x.reshape(-1, self.in_features)))
        return y.reshape(*x.shape[:-1], self.out_features)

    def _scaled_mm(self, x: QuantizedActivation) -> torch.Tensor:
        """``[T, out]`` in the activations' dtype: cuBLAS (``torch._scaled_mm``), or on a GPU
        whose matmul tuning says so for this shape, the Triton kernel of ``triton_gemm``."""
        bias = None if self.bias is None else self.bias.to(KERNEL_DTYPE)
        if (tile := gemm_tile(x.values, self.out_features, fp8=True)) is not None:
            from tokenmill.kernels.triton import gemm as triton_gemm

            y = triton_gemm.scaled_mm(x.values, x.scale, self.weight, self.weight_scale, bias,
                                   KERNEL_DTYPE, tile)
        else:
            y = torch._scaled_mm(x.values, self.weight.t(), scale_a=x.scale,
                                 scale_b=self.weight_scale, bias=bias, out_dtype=KERNEL_DTYPE)
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight ``[out, in]`` this module computes with, in fp32."""
        return self.weight.float() * self.weight_scale.reshape(-1, 1)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (an embedding lookup) in ``dtype``."""
        flat = ids.reshape(-1)
        rows = self.weight[flat].float() * self.weight_scale[0, flat].unsqueeze(1)
        return rows.to(dtype).view(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8=e4m3")
