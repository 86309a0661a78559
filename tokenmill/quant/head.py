"""Quantized output head and (tied) embedding table.

The models compute logits as ``F.linear(hidden, head_weight)`` where ``head_weight`` is
``lm_head.weight`` or, for tied embeddings, ``embed_tokens.weight``. The modules here expose a
:class:`QuantizedMatrix` as ``weight``: an object that ``F.linear`` hands back to the quantized
kernel through PyTorch's ``__torch_function__`` protocol, so model code stays unchanged.
For a 135M model the head is the largest matmul (576 x 49152: over a third of the weights
read per decoded token), so it is quantized with the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import tp_rank, tp_size
from tokenmill.models.parallel import vocab_parallel_lookup
from tokenmill.quant import kernel_choice
from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

QuantizedLinear = Int8WeightOnlyLinear | Int4WeightOnlyLinear


class QuantizedMatrix:
    """Stands in for a ``[out, in]`` weight: ``F.linear(x, m, bias)`` runs ``m.linear``.

    Any other torch function on it raises TypeError (it has no float values to offer).
    """

    def __init__(self, linear: QuantizedLinear, dtype: torch.dtype) -> None:
        self.linear = linear
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.linear.out_features, self.linear.in_features))

    @property
    def device(self) -> torch.device:
        return self.linear.weight.device

    @property
    def ndim(self) -> int:
        return 2

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: tuple[type, ...],
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], QuantizedMatrix):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = args[1].linear(args[0])
            return y if bias is None else y + bias
        return NotImplemented


class QuantizedHead(nn.Module):
    """An untied ``lm_head``: ``forward`` and ``F.linear(h, head.weight)`` both quantized."""

    def __init__(self, linear: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = linear
        self.dtype = dtype

    @property
    def weight(self) -> QuantizedMatrix:
        return QuantizedMatrix(self.linear, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class QuantizedEmbedding(nn.Module):
    """A tied embedding table stored once, quantized: lookups dequantize the rows they read,
    and ``F.linear(h, embedding.weight)`` (the tied head) runs the quantized matmul.

    Under tensor parallelism ``table`` is this rank's vocabulary shard (rows from
    ``rank * rows``, as ``VocabParallelEmbedding`` lays them out) and lookups are masked and
    all-reduced the same way.
    """

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings = table.out_features
        self.embedding_dim = table.in_features
        self.tp_size = tp_size()
        self.vocab_start = tp_rank() * table.out_features

    @property
    def weight(self) -> QuantizedMatrix:
        return QuantizedMatrix(self.table, self.dtype)

    def direct_lookup(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``forward`` as one C++ call (``int8_embedding``, the same bits) where the table is
        int8 with bf16 scales, the activations fp32 and the vocabulary whole; None elsewhere.
        For the fused decoder: PyTorch's three ops (index the rows, index their scales,
        multiply) took ~90 us of a ~5 ms decode step on a 2-core Xeon, the C++ loop ~15."""
        ext = kernel_choice.cpu_kernels()
        table = self.table
        if (ext is None or self.tp_size != 1 or self.dtype != torch.float32
                or not isinstance(table, Int8WeightOnlyLinear)
                or table.weight.device.type != "cpu" or table.scales.dtype != torch.bfloat16):
            return None
        dim = self.embedding_dim

        def lookup(input_ids: torch.Tensor) -> torch.Tensor:
            rows = ext.int8_embedding(input_ids.reshape(-1), table.weight, table.scales)
            return rows.view(*input_ids.shape, dim)

        return lookup

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.table.lookup(input_ids, self.dtype)
        return vocab_parallel_lookup(input_ids, self.vocab_start, self.num_embeddings,
                                     lambda ids: self.table.lookup(ids, self.dtype))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}"
