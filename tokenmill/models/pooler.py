"""Sentence embeddings from a model's hidden states: one vector per sequence of a flat batch.

A model's pooling says how a sequence's token states become one vector (sentence-transformers'
``1_Pooling/config.json`` for encoders, the engine's ``pooling`` option for decoders) and
whether it is scaled to unit length (a ``Normalize`` module). A request may ask for fewer
``dimensions`` (Matryoshka truncation), which are taken before normalising.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.config import POOLING_METHODS


@dataclass(frozen=True)
class PoolerConfig:
    """How a model's token states become one embedding: ``method`` "cls" (the first token's
    state), "mean" / "max" (over every token) or "last" (the last token's, which in a decoder
    has seen the whole sequence); ``normalize`` scales it to unit length."""

    method: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, "
                             f"got {self.method!r}")


def pool(hidden: torch.Tensor, spans: Sequence[tuple[int, int]], method: str) -> torch.Tensor:
    """``[len(spans), hidden]`` float32 vectors: ``method`` over the rows ``[start, start + n)``
    of ``hidden`` for each span ``(start, n)``."""
    if method == "cls":
        return hidden[[s for s, _ in spans]].float()
    if method == "last":
        return hidden[[s + n - 1 for s, n in spans]].float()
    rows = [hidden[s:s + n].float() for s, n in spans]
    if method == "mean":
        if len({n for _, n in spans}) == 1:  # equal lengths: one reduction
            return torch.stack(rows).mean(dim=1)
        return torch.stack([r.mean(dim=0) for r in rows])
    return torch.stack([r.amax(dim=0) for r in rows])


def finish_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """The first ``dimensions`` entries (all for None), scaled to unit length if ``normalize``."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    return F.normalize(vector, p=2.0, dim=-1) if normalize else vector
