"""TorchAttentionBackend against dense causal attention written out by hand."""

from __future__ import annotations

import pytest
import torch
from paged import PagedKVCache

from tokenmill.attention.backend import TorchAttentionBackend

HQ, HKV, D = 8, 2, 16


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
                    scale: float) -> torch.Tensor:
    """q ``[n, Hq, D]`` at positions past..past+n-1 over k/v ``[past+n, Hkv, D]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= torch.arange(past, past + n)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


def run_layer(cache: PagedKVCache, chunks: list[tuple[int, int]],
              history: dict[int, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on a one-layer cache; returns (backend output, dense reference)."""
    total = sum(n for _, n in chunks)
    q = torch.randn(total, HQ, D, generator=gen).to(dtype)
    k = torch.randn(total, HKV, D, generator=gen).to(dtype)
    v = torch.randn(total, HKV, D, generator=gen).to(dtype)
    meta, _ = cache.step(chunks)
    out = cache.backend.forward(q, k, v, cache.kv_caches[0], meta, D ** -0.5)
    refs = []
    row = 0
    for seq_id, n in chunks:
        old_k, old_v = history.get(seq_id, (k[:0], v[:0]))
        all_k = torch.cat([old_k, k[row:row + n]])
        all_v = torch.cat([old_v, v[row:row + n]])
        history[seq_id] = (all_k, all_v)
        refs.append(dense_attention(q[row:row + n], all_k, all_v, old_k.shape[0], D ** -0.5))
        row += n
    return out, torch.cat(refs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_backend_matches_dense_attention(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, HKV, D, num_blocks=48, block_size=4, dtype=dtype)
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    steps = [
        [(0, 7), (1, 1), (2, 13)],  # fresh prefills, one of a single token
        [(0, 1), (1, 1), (2, 1)],  # decode only
        [(0, 5), (1, 1), (3, 9), (2, 1)],  # continued chunk, decodes, a new prompt
        [(3, 1)],  # a lone decode
        [(1, 6)],  # a lone continued chunk
    ]
    for chunks in steps:
        out, ref = run_layer(cache, chunks, history, dtype, gen)
        assert out.dtype == dtype
        assert out.shape == ref.shape
        assert (out.float() - ref).abs().max().item() <= tol, chunks


def test_plan_is_cached_per_step() -> None:
    cache = PagedKVCache(2, HKV, D, num_blocks=16, block_size=4)
    meta, _ = cache.step([(0, 3), (1, 1)])
    backend = TorchAttentionBackend()
    q, kv = torch.randn(4, HQ, D), torch.randn(4, HKV, D)
    backend.forward(q, kv, kv, cache.kv_caches[0], meta, 1.0)
    plan = meta.backend_plan
    assert plan is not None
    backend.forward(q, kv, kv, cache.kv_caches[1], meta, 1.0)
    assert meta.backend_plan is plan


def test_query_len_mismatch_is_a_value_error() -> None:
    cache = PagedKVCache(1, HKV, D, num_blocks=8, block_size=4)
    meta, _ = cache.step([(0, 3)])
    q, kv = torch.randn(2, HQ, D), torch.randn(2, HKV, D)
    with pytest.raises(ValueError, match="query_lens_cpu"):
        TorchAttentionBackend().forward(q, kv, kv, cache.kv_caches[0], meta, 1.0)
