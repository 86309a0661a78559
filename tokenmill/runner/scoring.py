"""Scoring text under a model: the log-probability of each token given the ones before it.

For evaluations such as perplexity, outside the engine's scheduler: each sequence is one
fresh prompt through the model's own ``forward``, on a paged KV cache of its own laid out by
the runner's :class:`~tokenmill.runner.flat_batch.FlatBatch`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.core.kv_cache import blocks_for_tokens
from tokenmill.runner.flat_batch import FlatBatch
from tokenmill.runner.kv_memory import KVCacheShape
from tokenmill.utils import cdiv

# Rows of logits materialized at once: [rows, vocab] fp32 plus its log-softmax.
LOGIT_ROWS = 256


class PromptScorer:
    """Runs sequences of up to ``max_tokens`` tokens through ``model`` (a tokenmill model:
    ``forward(ids, positions, attn_meta)``, ``compute_logits`` and its KV geometry) and
    returns their tokens' log-probabilities."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, block_size: int = 16) -> None:
        shape = KVCacheShape(model.num_layers, block_size, model.num_kv_heads, model.head_dim,
                             dtype)
        num_blocks = blocks_for_tokens(max_tokens, block_size)
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.kv_caches = shape.allocate(num_blocks, device)
        self.block_ids = list(range(1, num_blocks))  # every block but the null block

    @torch.inference_mode()
    def token_logprobs(self, token_ids: Sequence[int], first_target: int = 1,
                       ) -> Iterator[torch.Tensor]:
        """The float32 log-probabilities of ``token_ids[first_target:]``, each given every
        token before it, in chunks of up to :data:`LOGIT_ROWS` tokens (the logits of one
        chunk exist at a time). ``token_ids`` is one sequence, from position 0."""
        n = len(token_ids)
        batch = FlatBatch(self.block_size)
        batch.add(token_ids, 0, self.block_ids[:cdiv(n, self.block_size)])
        input_ids, positions, meta = batch.build(self.backend, self.kv_caches, self.device)
        hidden = self.model(input_ids, positions, meta)
        # Row r's logits predict token r + 1.
        for r0 in range(first_target - 1, n - 1, LOGIT_ROWS):
            r1 = min(r0 + LOGIT_ROWS, n - 1)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[r0:r1]).float(), dim=-1)
            yield logprobs.gather(1, input_ids[r0 + 1:r1 + 1].unsqueeze(1)).squeeze(1)
