"""Quantized output head and (tied) embedding table.

Both give the model their logits' product as :meth:`logits`: the model chooses it once, when
the head is put in place (``DecoderForCausalLM.bind_head``), not at every call. For a 135M
model the head is the largest matmul (576 x 49152: over a third of the weights read per decoded
token), so it is quantized with the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.distributed import tp_rank, tp_size
from tokenmill.models.parallel import vocab_parallel_lookup
from tokenmill.quant import kernel_choice
from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

QuantizedLinear = Int8WeightOnlyLinear | Int4WeightOnlyLinear


class QuantizedHead(nn.Module):
    """An untied ``lm_head`` whose product (``forward``, :meth:`logits`) is quantized."""

    def __init__(self, linear: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = linear
        self.dtype = dtype

    @property
    def matrix(self) -> QuantizedLinear:
        """The quantized ``[vocab, hidden]`` product."""
        return self.linear

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ W.T`` through the quantized kernel."""
        return self.linear(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class QuantizedEmbedding(nn.Module):
    """A tied embedding table stored once, quantized: lookups dequantize the rows they read,
    and :meth:`logits` (the tied head) runs the quantized matmul.

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
    def matrix(self) -> QuantizedLinear:
        """The quantized ``[vocab, hidden]`` table, also the tied head's product."""
        return self.table

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ table.T`` through the quantized kernel (the tied head)."""
        return self.table(hidden)

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
