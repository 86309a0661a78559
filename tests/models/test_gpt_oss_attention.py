"""Attention sinks (gpt-oss) in the PyTorch and CPU backends against dense attention written
out by hand: a logit per query head in each softmax's denominator, with and without a sliding
window, over fresh prompts, continued chunks, decodes and mixed steps; no sinks is the plain
attention as before."""

from __future__ import annotations

import pytest
import torch
from paged import PagedKVCache

from tokenmill.attention.backend import AttentionBackend, TorchAttentionBackend
from tokenmill.attention.cpu_backend import cpu_attention_backend

HQ, HKV, D = 8, 2, 16
STEPS = [
    [(0, 7), (1, 1), (2, 13)],  # fresh prefills, one of a single token
    [(0, 1), (1, 1), (2, 1)],  # decode only
    [(0, 5), (1, 1), (3, 9), (2, 1)],  # continued chunk, decodes, a new prompt
    [(3, 1)],  # a lone decode
    [(1, 6)],  # a lone continued chunk
]


def dense_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
                     scale: float, sinks: torch.Tensor | None,
                     window: int | None) -> torch.Tensor:
    """q ``[n, Hq, D]`` at positions past..past+n-1 over k/v ``[past+n, Hkv, D]``, each
    head's sink one more logit of the denominator: ``[n, Hq * D]``."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).double() for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    n, total = q.shape[0], k.shape[0]
    keys, rows = torch.arange(total)[None, :], torch.arange(past, past + n)[:, None]
    allowed = keys <= rows
    if window is not None:
        allowed &= keys > rows - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.exp()
    denom = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + sinks.double().exp()[:, None, None]
    probs = weights / denom
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1).float()


def run_steps(backend: AttentionBackend, sinks: torch.Tensor | None,
              window: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(backend output, dense reference) of each of STEPS on a one-layer cache."""
    gen = torch.Generator().manual_seed(5)
    cache = PagedKVCache(1, HKV, D, num_blocks=32, block_size=4, backend=backend)
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    results = []
    for chunks in STEPS:
        total = sum(n for _, n in chunks)
        q = torch.randn(total, HQ, D, generator=gen)
        k = torch.randn(total, HKV, D, generator=gen)
        v = torch.randn(total, HKV, D, generator=gen)
        meta, _ = cache.step(chunks)
        out = backend.forward(q, k, v, cache.kv_caches[0], meta, D ** -0.5, window=window,
                              sinks=sinks)
        refs, row = [], 0
        for seq_id, n in chunks:
            old_k, old_v = history.get(seq_id, (k[:0], v[:0]))
            history[seq_id] = (torch.cat([old_k, k[row:row + n]]),
                               torch.cat([old_v, v[row:row + n]]))
            refs.append(dense_with_sinks(q[row:row + n], *history[seq_id], old_k.shape[0],
                                         D ** -0.5, sinks, window))
            row += n
        results.append((out, torch.cat(refs)))
    return results


BACKENDS = {"torch": TorchAttentionBackend, "cpu": cpu_attention_backend}


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_sinks_match_dense_attention(backend: str, window: int | None) -> None:
    # Large sinks on some heads (most of the mass), small on others: every head's share shows.
    sinks = torch.tensor([2.5, -1.0, 0.3, 4.0, -3.0, 1.2, 0.0, 6.0])
    for i, (out, ref) in enumerate(run_steps(BACKENDS[backend](), sinks, window)):
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-5, f"step {i}"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_no_sinks_is_plain_attention_and_sinks_change_it(backend: str) -> None:
    plain = run_steps(BACKENDS[backend](), None, None)
    for out, ref in plain:
        assert (out - ref).abs().max().item() <= 1e-5
    sunk = run_steps(BACKENDS[backend](), torch.full((HQ,), 1.0), None)
    for (out, _), (base, _) in zip(sunk, plain, strict=True):
        assert (out - base).abs().max().item() > 1e-2
