"""An activation already quantized to fp8 (e4m3) per token, handed from the kernel that
produced it (an RMSNorm, SiLU-and-mul) to the fp8 linear that reads it.

On CUDA, ``quant.fp8.Fp8Linear`` quantizes its input before every ``torch._scaled_mm``: one
more kernel and one more round trip through memory per linear. Where the producer is one of
the layers' fused kernels (``fused_ops``), that kernel writes the e4m3 values and the scales
itself, and hands them on in this form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# e4m3's largest finite value: scales map each row's (or token's) largest magnitude onto it.
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class QuantizedActivation:
    """Rows of activations as ``values * scale``: each row's largest magnitude maps onto
    :data:`FP8_MAX` (scale 1 for an all-zero row), the same bytes ``Fp8Linear`` makes of the
    unquantized rows."""

    values: torch.Tensor  # [T, K], e4m3
    scale: torch.Tensor  # [T, 1], fp32
    dtype: torch.dtype  # the activations' dtype before quantizing: the consumer's output dtype
