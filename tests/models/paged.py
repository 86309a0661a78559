"""Test helper: a paged KV cache with shuffled blocks, and the AttentionMetadata for a step.

Test files in this folder import it as ``from paged import ...``; other test folders can put
``tests/models`` on ``sys.path`` to reuse it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, TorchAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.config import ArchConfig


class PagedKVCache:
    """Per-layer KV tensors, a shuffled free-block list and one block table per sequence.

    Unused slots hold large random numbers, so attending to a slot that was never written
    shows up as a wrong result instead of a harmless zero.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int = 64,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0,
                 backend: AttentionBackend | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [(torch.randn(shape, generator=gen) * 100).to(dtype)
                          for _ in range(num_layers)]
        self.block_size = block_size
        self.backend = backend or TorchAttentionBackend()
        # Shuffled so that consecutive blocks of a sequence are not adjacent in memory.
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}

    @classmethod
    def for_arch(cls, arch: ArchConfig, **kwargs: object) -> PagedKVCache:
        """A cache shaped for ``arch`` (layers, KV heads, head_dim)."""
        return cls(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                   **kwargs)  # type: ignore[arg-type]

    def clone(self) -> PagedKVCache:
        """An independent copy (tensors and tables), to replay a step another way."""
        other = copy.copy(self)
        other.kv_caches = [t.clone() for t in self.kv_caches]
        other.free_blocks = list(self.free_blocks)
        other.tables = {k: list(v) for k, v in self.tables.items()}
        other.num_cached = dict(self.num_cached)
        return other

    def step(self, chunks: list[tuple[int, int]]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata and positions for a step adding ``(seq_id, num_new_tokens)`` per sequence.

        Allocates blocks as needed and advances each sequence's cached length.
        """
        bs = self.block_size
        slots: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq_id, n in chunks:
            start = self.num_cached.get(seq_id, 0)
            end = start + n
            table = self.tables.setdefault(seq_id, [])
            while len(table) * bs < end:
                table.append(self.free_blocks.pop())
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            positions.extend(range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(table)
            self.num_cached[seq_id] = end
        width = max(len(t) for t in tables)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            backend=self.backend,
            kv_caches=self.kv_caches,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        return meta, torch.tensor(positions, dtype=torch.int64)


@torch.no_grad()
def run_step(model: nn.Module, cache: PagedKVCache,
             batch: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
    """One forward step over ``(seq_id, new_token_ids)``; returns ``[n_i, vocab]`` logits each."""
    meta, positions = cache.step([(seq_id, len(ids)) for seq_id, ids in batch])
    input_ids = torch.tensor([t for _, ids in batch for t in ids], dtype=torch.int64)
    logits = model.compute_logits(model(input_ids, positions, meta))
    return list(logits.split(meta.query_lens_cpu))
