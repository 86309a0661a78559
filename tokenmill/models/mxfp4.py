"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in), dequantized at load.

A row of ``N`` weights is stored as ``N / 32`` blocks of 16 bytes (``*_blocks``, two 4-bit
E2M1 values a byte, the low nibble first) and one byte a block (``*_scales``): the block's
power-of-two scale as an exponent biased by 127.
"""

from __future__ import annotations

import torch

# The 16 E2M1 values a nibble stands for (sign bit, two exponent bits, one mantissa bit).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., G * 32]`` weights in ``dtype`` from ``blocks`` ``[..., G, 16]`` and ``scales``
    ``[..., G]``. Either may come as bytes or as floats holding the byte values (a loader that
    casts every tensor to the model's dtype keeps 0..255 exact in fp32, fp16 and bf16)."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks of shape {tuple(blocks.shape)} do not match scales of "
                         f"shape {tuple(scales.shape)} (expected [..., G, 16] and [..., G])")
    if blocks.ndim > 3:  # one expert at a time: the temporaries of a whole stack are GBs
        return torch.stack([dequantize_mxfp4(b, s, dtype) for b, s in zip(blocks, scales,
                                                                            strict=True)])
    codes = blocks.to(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    # Low nibble first: byte j of a block holds values 2j and 2j + 1.
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1))
    return out.flatten(-2).to(dtype)
