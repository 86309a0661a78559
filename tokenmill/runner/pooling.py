"""The runner's side of embedding requests: an encoder's flat batch (no KV cache), and the
pooled, truncated, normalised vector of each request whose prompt a step computed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.pooler import PoolerConfig, finish_embedding, pool
from tokenmill.sampling_params import PoolingParams
from tokenmill.utils import host_tensor


class EncoderBatch:
    """A step's sequences for an encoder: tokens back to back, positions from 0, and
    metadata that gives only the sequence boundaries. The same ``add`` / ``build`` as
    :class:`~tokenmill.runner.flat_batch.FlatBatch`, whose KV arguments it ignores: an encoder
    computes each sequence whole and keeps nothing."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.lens: list[int] = []

    def add(self, token_ids: Sequence[int], start: int, block_ids: list[int],
            split: bool = False) -> int:
        """Add a whole sequence (``start`` is 0: nothing of it is cached); returns its first
        row."""
        assert start == 0, "an encoder computes a sequence in one step"
        row0 = len(self.ids)
        self.ids.extend(token_ids)
        self.positions.extend(range(len(token_ids)))
        self.lens.append(len(token_ids))
        return row0

    def build(self, backend: AttentionBackend, kv_caches: list[torch.Tensor],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and the boundary-only attention metadata."""
        starts = [0]
        for n in self.lens:
            starts.append(starts[-1] + n)
        empty = torch.empty(0, dtype=torch.int64, device=device)
        meta = AttentionMetadata(
            backend=backend, kv_caches=[], slot_mapping=empty,
            query_start_loc=host_tensor(starts, torch.int32, device),
            seq_lens=host_tensor(self.lens, torch.int32, device),
            block_tables=torch.empty(len(self.lens), 0, dtype=torch.int32, device=device),
            query_lens_cpu=list(self.lens), seq_lens_cpu=list(self.lens), block_size=1)
        return (host_tensor(self.ids, torch.int64, device),
                host_tensor(self.positions, torch.int64, device), meta)


def pool_embeddings(hidden: torch.Tensor, spans: Sequence[tuple[int, int]],
                    params: Sequence[PoolingParams | None], pooler: PoolerConfig,
                    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    ) -> list[list[float]]:
    """Each request's embedding from its rows ``(start, n)`` of ``hidden``: pooled as the
    model says, cut to its ``dimensions``, normalised unless it says otherwise. A
    cross-encoder's ``head`` (``score_head``) turns the pooled states into its pairs' scores,
    which are given as they are."""
    vectors = pool(hidden, spans, pooler.method)
    if head is not None:
        return head(vectors).cpu().tolist()
    out: list[torch.Tensor] = []
    for vector, p in zip(vectors, params, strict=True):
        p = p or PoolingParams()
        normalize = pooler.normalize if p.normalize is None else p.normalize
        out.append(finish_embedding(vector, p.dimensions, normalize))
    if all(v.shape == out[0].shape for v in out):  # one host copy for the whole step
        return torch.stack(out).cpu().tolist()
    return [v.cpu().tolist() for v in out]
