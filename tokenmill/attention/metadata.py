"""What an attention backend needs to know about one forward step over a flat batch of tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.attention.backend import AttentionBackend


@dataclass
class AttentionMetadata:
    """One step's batch layout, built by the model runner.

    The step's tokens are flattened: sequence ``i`` owns the rows
    ``query_start_loc[i]:query_start_loc[i+1]`` of q/k/v, which are the *last* ``query_lens[i]``
    positions of a context of ``seq_lens[i]`` tokens (earlier positions are already in the cache).
    """

    backend: AttentionBackend
    # One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]: [0] keys, [1] values.
    kv_caches: list[torch.Tensor]
    # [num_tokens] int64: cache slot (block_id * block_size + offset) each new token's K/V goes to.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: cumulative query lengths, starting at 0.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: physical block ids of each sequence, padded with 0.
    block_tables: torch.Tensor
    # Host copies, so that backends need no device-to-host sync to plan the step.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Fixed upper bound on seq_lens, set by a CUDA-graph runner to the length it captured for, so
    # that decode kernels size their launch from it instead of from this step's lengths (a
    # replayed graph cannot change its grid). None outside graphs: backends use max_seq_len.
    max_seq_len_bound: int | None = None
    # The longest context the decode launch is chosen for (decode_tuning's context classes): a
    # CUDA-graph runner sets it to the class a graph is captured for, whose steps have no
    # longer context, so it also bounds the decode grid. None: max_seq_len.
    launch_context: int | None = None
    # Backend-private plan of this step's layout (gather indices, masks), built by the backend on
    # the first layer's call and reused by the others, so per-layer work stays minimal.
    backend_plan: object | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def decode_only(self) -> bool:
        """Every sequence adds exactly one token this step."""
        return self.max_query_len == 1
