"""Weight-only int8 / int4 replacements for ``nn.Linear`` on the CPU.

Few rows (decode) run PyTorch's weight-only kernels, which read 1 or 0.5 byte per weight
instead of 4 and beat the fp32 matmul about 2x. Many rows (prefill) are compute-bound, where
those kernels lose to a bf16 matmul; there the weight is dequantized to bf16 on the fly for
one dense matmul (see benchmarks/results/quant-kernels-cpu.md for the measurements behind
``dense_min_rows``). Either way activations go to the kernel in bf16 and the result comes
back in the input's dtype; the bias is added before that cast.

``tokenmill.runner.fused_decode`` reads these modules' tensors (``weight``, ``bias``,
``scales`` / ``scales_and_zeros``, ``group_size``) and repeats the small-batch path in C++.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quant.packing import (
    KERNEL_DTYPE,
    Int4Groups,
    dequantize_int4_t,
    dequantize_int8,
    int4_layout_known,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    unpack_int4_rows,
)

# Rows from which the dense bf16 path wins, measured on SmolLM2-135M's shapes (see
# benchmarks/results/quant-kernels-cpu.md). Dequantizing a weight that does not fit in cache
# (the 576 x 49152 head) costs several times more per element, which moves the crossover.
INT8_DENSE_MIN_ROWS = 48
INT4_DENSE_MIN_ROWS = 96
LARGE_WEIGHT_NUMEL = 1 << 23
INT8_LARGE_DENSE_MIN_ROWS = 256
INT4_LARGE_DENSE_MIN_ROWS = 512


class _WeightOnlyLinear(nn.Module):
    """What the int8 and int4 modules share: shapes, bias, the row-count dispatch."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 dense_min_rows: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # Rows from which forward() dequantizes for one bf16 matmul; tests move it.
        self.dense_min_rows = dense_min_rows
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        xb = x2.to(KERNEL_DTYPE)
        # The int kernels are CPU ones; anywhere else the dense path is plain torch.
        if x2.shape[0] >= self.dense_min_rows or x2.device.type != "cpu":
            y = self._dense(xb)
        else:
            y = self._kernel(xb)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dense(self, xb: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight ``[out, in]`` this module computes with, in fp32."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Int8WeightOnlyLinear(_WeightOnlyLinear):
    """``y = x @ (weight * scales[:, None]).T + bias`` with int8 weights, one scale per row.

    ``weight`` is int8 ``[out, in]``, ``scales`` bf16 ``[out]``.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dense_min_rows: int | None = None) -> None:
        out_features, in_features = weight.shape
        if dense_min_rows is None:
            dense_min_rows = (INT8_LARGE_DENSE_MIN_ROWS if weight.numel() > LARGE_WEIGHT_NUMEL
                              else INT8_DENSE_MIN_ROWS)
        super().__init__(in_features, out_features, bias, dense_min_rows)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8WeightOnlyLinear:
        """Quantize a float weight ``[out, in]`` (symmetric, per output channel)."""
        q, scales = quantize_int8(weight)
        return cls(q, scales, bias)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(xb, self.weight, self.scales)

    def _dense(self, xb: torch.Tensor) -> torch.Tensor:
        return F.linear(xb, dequantize_int8(self.weight, self.scales, KERNEL_DTYPE))

    def dequantize(self) -> torch.Tensor:
        return dequantize_int8(self.weight, self.scales, torch.float32)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (an embedding lookup) in ``dtype``."""
        flat = ids.reshape(-1)
        rows = dequantize_int8(self.weight[flat], self.scales[flat], dtype)
        return rows.view(*ids.shape, self.in_features)


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    """``y = x @ w.T + bias`` with ``w = (q - 8) * scale + zero`` per group of input columns.

    ``weight`` holds the nibbles packed by ``_convert_weight_to_int4pack_for_cpu``;
    ``scales_and_zeros`` is bf16 ``[in // group_size, out, 2]``.
    """

    def __init__(self, weight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 out_features: int, bias: torch.Tensor | None,
                 dense_min_rows: int | None = None) -> None:
        in_features = scales_and_zeros.shape[0] * group_size
        if dense_min_rows is None:
            large = out_features * in_features > LARGE_WEIGHT_NUMEL
            dense_min_rows = INT4_LARGE_DENSE_MIN_ROWS if large else INT4_DENSE_MIN_ROWS
        super().__init__(in_features, out_features, bias, dense_min_rows)
        self.group_size = group_size
        self.register_buffer("weight", weight)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        # Dense decoding reads the packed layout: only where it is the known one, and whole
        # blocks of 64 rows make it a handful of views.
        self._can_decode = out_features % 64 == 0 and int4_layout_known()

    @classmethod
    def from_groups(cls, groups: Int4Groups, bias: torch.Tensor | None) -> Int4WeightOnlyLinear:
        """Pack 4-bit weights in the plain layout (see :class:`Int4Groups`)."""
        packed, scales_and_zeros = pack_int4(groups)
        return cls(packed, scales_and_zeros, groups.group_size, groups.q.shape[0], bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                    group_size: int = 32) -> Int4WeightOnlyLinear:
        """Quantize a float weight ``[out, in]`` (asymmetric min/max per group)."""
        return cls.from_groups(quantize_int4(weight, group_size), bias)

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.weight, self.group_size,
                                                          self.scales_and_zeros)

    def _dense(self, xb: torch.Tensor) -> torch.Tensor:
        if not self._can_decode:
            return self._kernel(xb)
        w_t = dequantize_int4_t(self.weight, self.scales_and_zeros, self.group_size,
                                self.out_features, self.in_features)
        return xb @ w_t

    def nibbles(self) -> torch.Tensor:
        """The 4-bit values ``[out, in]`` (uint8 in [0, 15])."""
        return unpack_int4(self.weight, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        q = self.nibbles().float().view(self.out_features, -1, g) - 8.0
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [out, groups, 2]
        w = q * sz[..., 0:1] + sz[..., 1:2]
        return w.view(self.out_features, self.in_features)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (an embedding lookup) in ``dtype``."""
        flat = ids.reshape(-1)
        q = unpack_int4_rows(self.weight, self.out_features, self.in_features, flat)
        sz = self.scales_and_zeros[:, flat].transpose(0, 1).float()  # [R, groups, 2]
        q = q.float().view(flat.shape[0], -1, self.group_size) - 8.0
        rows = (q * sz[..., 0:1] + sz[..., 1:2]).view(flat.shape[0], self.in_features)
        return rows.to(dtype).view(*ids.shape, self.in_features)
