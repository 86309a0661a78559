"""Paged attention with Triton kernels, for CUDA.

Needs the ``triton`` package: import this module only where it is installed (it is not
imported by ``tokenmill`` itself).
"""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels.triton.attention import FP8_CACHE_DTYPES, rotary_store_kv, store_kv
from tokenmill.kernels.triton.attention_decode import decode_attention
from tokenmill.kernels.triton.attention_prefill import prefill_attention, prefill_tiles
from tokenmill.kernels.tuning.decode_attention import DecodeTuning


class TritonAttentionBackend(AttentionBackend):
    """Stores the step's K/V, then runs split-K decode or variable-length prefill kernels.

    ``forward_rotary`` applies the rotary embedding in the store's kernel: q in place, the keys
    as they are written (every attention kernel reads them back from the cache).

    A decode-only step (every sequence adds one token) uses flash decoding, whose launch
    depends only on shapes and ``meta.max_seq_len_bound`` (when set), so it can be captured in
    a CUDA graph. Any other step goes through the prefill kernel, which takes one-token
    sequences as well, so mixed batches and split layouts need no second launch.
    """

    name = "triton"
    # Decode steps may be captured in CUDA graphs (tokenmill.runner.cuda_graphs).
    supports_cuda_graphs = True
    fuses_rotary = True

    def __init__(self, decode_partition_size: int | None = None,
                 decode_tuning: DecodeTuning | None = None) -> None:
        # The decode kernel's launch settings by batch size: the platform passes its GPU's
        # (tokenmill.kernels.tuning.decode_attention); the defaults without.
        self.decode_tuning = decode_tuning or DecodeTuning()
        # Tokens per decode split, overriding the tuning's (tests).
        self.decode_partition_size = decode_partition_size

    def decode_context_classes(self, batch: int, kv_cache: torch.Tensor) -> tuple[int | None, ...]:
        return self.decode_tuning.context_classes(batch, kv_cache.dtype in FP8_CACHE_DTYPES)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, scale, window, sinks)

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                       cos: torch.Tensor, sin: torch.Tensor,
                       window: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        # Every kernel below reads the keys from the cache, so k need not be rotated itself.
        rotary_store_kv(q, k, v, kv_cache, meta.slot_mapping, cos, sin)
        return self._attend(q, kv_cache, meta, scale, window, sinks)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The attention of ``q`` over the cache, which already holds the step's K/V; with
        ``window``, each query over the keys of its sliding window only; with ``sinks``, each
        head's sink logit in its softmax's denominator."""
        num_tokens, num_heads, head_dim = q.shape
        out = q.new_empty(num_tokens, num_heads, head_dim)
        if meta.decode_only:
            bound = meta.max_seq_len_bound
            context = meta.max_seq_len if meta.launch_context is None else meta.launch_context
            launch = self.decode_tuning.for_batch(
                num_tokens, fp8_cache=kv_cache.dtype in FP8_CACHE_DTYPES,
                context=context).kwargs()
            if self.decode_partition_size is not None:
                launch["partition_size"] = self.decode_partition_size
            if bound is None:
                bound = meta.max_seq_len
            elif meta.launch_context is not None:
                # A graph of a context class serves contexts up to its bound only: a grid
                # that long (one partition, with no reduction, when it fits) covers them.
                bound = min(bound, meta.launch_context)
            decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, bound,
                             out=out, window=window, sinks=sinks, **launch)
        elif num_tokens:
            if sum(meta.query_lens_cpu) != num_tokens:
                raise ValueError(f"query_lens_cpu sums to {sum(meta.query_lens_cpu)} "
                                 f"but q has {num_tokens} rows")
            # The tile list is the same for every layer: built on the first, kept on meta.
            tiles = meta.backend_plan
            if not isinstance(tiles, torch.Tensor):
                tiles = prefill_tiles(meta.query_lens_cpu, num_heads, kv_cache.shape[3],
                                      q.device)
                meta.backend_plan = tiles
            prefill_attention(q, kv_cache, meta.block_tables, meta.query_start_loc,
                              meta.seq_lens, scale, meta.query_lens_cpu, out=out, tiles=tiles,
                              window=window, sinks=sinks)
        return out.view(num_tokens, num_heads * head_dim)
