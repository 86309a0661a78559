"""``KQuantLinear``: a weight-only linear layer on a GGUF tensor's own blocks, as in the file.

Q4_K_M and its siblings store each tensor in a block type of its own (Q4_K, Q6_K, Q5_0,
Q8_0...): super-blocks of 256 weights with 6-bit sub-scales and mins, or blocks of 32 with one
fp16 scale. This layer keeps those bytes as they are (no second copy, no widening: the model
takes the file's bytes in memory) and multiplies by them with the C++ kernels of
``tokenmill/kernels/cpu/kquant.h``: activations quantized to int8 per block, integer dot
products as llama.cpp computes them. Many rows (prefill) dequantize the weight for one dense
matmul instead, as the int8 / int4 layers do (``dense_min_rows``).

The activations go in and come out in the model's dtype (fp32 stays fp32, unlike the int8 /
int4 layers, which round to bf16 around their kernels); the CPU op program
(``tokenmill.runner.cpu_linear``) takes them the same way and computes the same bits as this
module.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from tokenmill.quant import kernel_choice
from tokenmill.quant.linear import _WeightOnlyLinear
from tokenmill.quant.packing import KERNEL_DTYPE, dense_dtype

# The GGML types with a kernel here (ggml's ids, as GGMLQuantizationType numbers them).
KQUANT_TYPES: tuple[GGMLQuantizationType, ...] = (
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K, GGMLQuantizationType.IQ4_XS,
)
# Rows from which a call dequantizes the weight for one dense matmul (bf16 where the CPU
# multiplies it natively): measured in benchmarks/results/kquant-kernels-cpu.md.
KQUANT_DENSE_MIN_ROWS = 48


def supported_type_names() -> str:
    """The supported types' names, for error messages."""
    return ", ".join(t.name for t in KQUANT_TYPES)


def check_kquant_type(qtype: GGMLQuantizationType, what: str) -> None:
    """ValueError naming ``what``, its type and the supported types unless a kernel takes it."""
    if qtype not in KQUANT_TYPES:
        raise ValueError(f"{what}: GGUF type {qtype.name} has no CPU kernel here; supported "
                         f"types: {supported_type_names()}")


class KQuantLinear(_WeightOnlyLinear):
    """``y = x @ W.T + bias`` with ``W`` held as GGUF tensors' blocks.

    ``weight`` is uint8: the blocks of each output row, exactly as stored in the file (rows in
    the model's order), for one or more segments of rows, each of one GGML type (a fused q/k/v
    projection of a Q4_K_M file mixes Q4_K and Q6_K); ``segments`` is int64 ``[S, 2]``: each
    segment's (type, rows), in order.
    """

    def __init__(self, parts: list[tuple[torch.Tensor, GGMLQuantizationType | int]],
                 in_features: int, bias: torch.Tensor | None,
                 dense_min_rows: int = KQUANT_DENSE_MIN_ROWS) -> None:
        if not parts:
            raise ValueError("KQuantLinear needs at least one tensor of blocks")
        table = []
        for blocks, ggml_type in parts:
            qtype = GGMLQuantizationType(int(ggml_type))
            check_kquant_type(qtype, "KQuantLinear")
            _check_blocks(blocks, qtype, in_features)
            table.append((int(qtype), blocks.shape[0]))
        super().__init__(in_features, sum(rows for _, rows in table), bias, dense_min_rows)
        flat = torch.cat([blocks.reshape(-1) for blocks, _ in parts]) if len(parts) > 1 \
            else parts[0][0].reshape(-1).contiguous()
        self.register_buffer("weight", flat)
        self.register_buffer("segments", torch.tensor(table, dtype=torch.int64))
        # On CUDA: the Triton matmul that reads the blocks as stored, where it has every
        # segment's type (the table kept as a host list: no device read a call); else the
        # dense path. Which one is learned at the first CUDA call (Triton imported there).
        self._table = table
        self._triton_matmul: Callable[..., torch.Tensor] | None | bool = False

    def type_names(self) -> list[str]:
        """Each segment's GGML type name ("Q4_K", ...), in order."""
        return [GGMLQuantizationType(int(t)).name for t in self.segments[:, 0]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        ext = kernel_choice.cpu_kernels() if x2.device.type == "cpu" else None
        if x2.is_cuda and x2.shape[0] < self.dense_min_rows and (
                matmul := self._cuda_matmul()) is not None:
            y = matmul(x2, self.weight, self._table)
        elif ext is not None and x2.shape[0] < self.dense_min_rows:
            # x as it comes: fp32 stays fp32 into the int8 quantization, as in llama.cpp, not
            # rounded to bf16 first as the int8 / int4 layers do (see the module docstring)
            xk = x2 if x2.dtype in (torch.float32, KERNEL_DTYPE) else x2.float()
            y = ext.kquant_linear(xk.contiguous(), self.weight, self.segments)
        else:
            y = self._dense(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _cuda_matmul(self) -> Callable[..., torch.Tensor] | None:
        """The Triton K-quant matmul where it reads every segment's type, else None (the
        dense path); looked up once."""
        if self._triton_matmul is False:
            from tokenmill.kernels.triton.kquant import KQUANT_TYPES, kquant_matmul_segments

            names = [GGMLQuantizationType(t).name for t, _ in self._table]
            self._triton_matmul = (kquant_matmul_segments
                                   if all(n in KQUANT_TYPES for n in names) else None)
        return self._triton_matmul  # type: ignore[return-value]

    def _dense(self, xb: torch.Tensor) -> torch.Tensor:
        dtype = dense_dtype(xb.device.type)
        return F.linear(xb.to(dtype), self.dequantize(dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype`` (ggml's dequantization, rounded once)."""
        ext = kernel_choice.cpu_kernels() if self.weight.device.type == "cpu" else None
        if ext is not None and dtype in (torch.float32, torch.bfloat16):
            return ext.kquant_dequantize(self.weight, self.segments, self.in_features,
                                         dtype == torch.bfloat16)
        data = self.weight.cpu().numpy()
        rows, start = [], 0
        for ggml_type, n in self.segments.tolist():
            qtype = GGMLQuantizationType(ggml_type)
            nbytes = n * _row_bytes(qtype, self.in_features)
            seg = data[start:start + nbytes].reshape(n, -1)
            rows.append(np.asarray(gguf_dequantize(seg, qtype), dtype=np.float32))
            start += nbytes
        return torch.from_numpy(np.concatenate(rows)).to(self.weight.device, dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, types={self.type_names()}"


def _row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    return in_features // block_elems * block_bytes


def _check_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> None:
    block_elems = GGML_QUANT_SIZES[qtype][0]
    if in_features % block_elems:
        raise ValueError(f"in_features {in_features} is not a multiple of {qtype.name}'s "
                         f"block of {block_elems}")
    row_bytes = _row_bytes(qtype, in_features)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
        raise ValueError(f"{qtype.name} blocks must be uint8 [rows, {row_bytes}], got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")
