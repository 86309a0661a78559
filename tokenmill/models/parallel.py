"""Tensor-parallel pieces of the models: how dimensions split across ranks, the
vocab-parallel embedding, and slicing a checkpoint tensor down to this rank's part.

Megatron's layout: q/k/v and gate/up are column-parallel (each rank holds whole heads and a
slice of the MLP), o_proj and down_proj row-parallel (partial sums, added by one all-reduce
per block), the vocabulary split by rows in the embedding and the head. At one rank every
helper here is the identity.

Modules read the rank count once, when built, and skip the collectives when it is 1: a model
built for one process stays one even while a tensor-parallel engine runs in the same process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.distributed import tensor_model_parallel_all_reduce, tp_rank, tp_size


def divide(value: int, parts: int, name: str) -> int:
    """``value / parts``; ValueError naming the config field when it does not divide."""
    if value % parts:
        raise ValueError(f"{name} ({value}) must be divisible by tensor_parallel_size ({parts})")
    return value // parts


@dataclass(frozen=True)
class VocabShard:
    """Rows ``[start, start + rows)`` of a vocabulary padded to a multiple of the rank count.

    Padding instead of refusing: vocabularies such as 32001 still split. The padded rows are
    zeros in the embedding and logit columns the head drops after the all-gather.
    """

    start: int
    rows: int

    @classmethod
    def of(cls, vocab_size: int, rank: int | None = None, size: int | None = None) -> VocabShard:
        """This rank's (or ``rank`` of ``size``'s) shard of ``vocab_size`` rows."""
        rank = tp_rank() if rank is None else rank
        size = tp_size() if size is None else size
        rows = -(-vocab_size // size)
        return cls(rank * rows, rows)


def vocab_parallel_lookup(input_ids: torch.Tensor, start: int, rows: int,
                          lookup: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Embedding rows of ``input_ids`` when this rank holds rows ``[start, start + rows)``.

    Ids of other ranks look up zeros here; the all-reduce adds the one rank that holds each.
    Callers with the whole vocabulary call ``lookup`` directly.
    """
    local = input_ids - start
    inside = (local >= 0) & (local < rows)
    out = lookup(torch.where(inside, local, 0))
    out.masked_fill_(~inside.unsqueeze(-1), 0)
    return tensor_model_parallel_all_reduce(out)


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding split by vocabulary rows over the TP ranks (the whole table at
    one rank). Skips the random init, like ``layers.Embedding``."""

    def __init__(self, vocab_size: int, embedding_dim: int) -> None:
        self.shard = VocabShard.of(vocab_size)
        super().__init__(self.shard.rows, embedding_dim)
        self.tp_size = tp_size()

    def reset_parameters(self) -> None:
        pass

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        return vocab_parallel_lookup(input_ids, self.shard.start, self.shard.rows,
                                     super().forward)


def copy_rank_slice(dst: torch.Tensor, tensor: torch.Tensor, dim: int | None,
                    rank: int | None = None) -> None:
    """Copy ``rank``'s (default: this rank's) slice of checkpoint ``tensor`` along ``dim``
    into ``dst`` (all of it for ``dim`` None). Rank r takes ``dst.shape[dim]`` entries from
    ``r * dst.shape[dim]``; the last rank of a padded vocabulary gets fewer, and its remaining
    rows are zeroed."""
    if dim is None:
        dst.copy_(tensor)
        return
    per_rank = dst.shape[dim]
    begin = (tp_rank() if rank is None else rank) * per_rank
    n = max(0, min(per_rank, tensor.shape[dim] - begin))
    dst.narrow(dim, 0, n).copy_(tensor.narrow(dim, begin, n))
    if n < per_rank:
        dst.narrow(dim, n, per_rank - n).zero_()


def check_all_loaded(expected: Iterable[str], loaded: set[str]) -> None:
    """ValueError naming (up to eight of) the ``expected`` checkpoint tensors not in ``loaded``,
    once a checkpoint's tensors are exhausted."""
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing tensors {shown}{more}")
