"""The attention backends (PyTorch's, and the CPU one with the extension's prefill kernel)
against dense causal attention written out by hand."""

from __future__ import annotations

import pytest
import torch
from paged import PagedKVCache

from tokenmill.attention.backend import AttentionBackend, TorchAttentionBackend
from tokenmill.attention.cpu_backend import CpuAttentionBackend, cpu_attention_backend

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
              gen: torch.Generator, hq: int = HQ, hkv: int = HKV, d: int = D,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on a one-layer cache; returns (backend output, dense reference)."""
    total = sum(n for _, n in chunks)
    q = torch.randn(total, hq, d, generator=gen).to(dtype)
    k = torch.randn(total, hkv, d, generator=gen).to(dtype)
    v = torch.randn(total, hkv, d, generator=gen).to(dtype)
    meta, _ = cache.step(chunks)
    out = cache.backend.forward(q, k, v, cache.kv_caches[0], meta, d ** -0.5)
    if cache.kv_caches[0].dtype != dtype:  # the backend attends over the stored values
        k, v = k.to(cache.kv_caches[0].dtype).to(dtype), v.to(cache.kv_caches[0].dtype).to(dtype)
    refs = []
    row = 0
    for seq_id, n in chunks:
        old_k, old_v = history.get(seq_id, (k[:0], v[:0]))
        all_k = torch.cat([old_k, k[row:row + n]])
        all_v = torch.cat([old_v, v[row:row + n]])
        history[seq_id] = (all_k, all_v)
        refs.append(dense_attention(q[row:row + n], all_k, all_v, old_k.shape[0], d ** -0.5))
        row += n
    return out, torch.cat(refs)


STEPS = [
    [(0, 7), (1, 1), (2, 13)],  # fresh prefills, one of a single token
    [(0, 1), (1, 1), (2, 1)],  # decode only
    [(0, 5), (1, 1), (3, 9), (2, 1)],  # continued chunk, decodes, a new prompt
    [(3, 1)],  # a lone decode
    [(1, 6)],  # a lone continued chunk
]


def cpu_backend() -> CpuAttentionBackend:
    backend = cpu_attention_backend()
    assert isinstance(backend, CpuAttentionBackend), "the C++ extension did not build"
    return backend


@pytest.mark.parametrize("make_backend", [TorchAttentionBackend, cpu_backend])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_backend_matches_dense_attention(make_backend: type[AttentionBackend],
                                         dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, HKV, D, num_blocks=48, block_size=4, dtype=dtype,
                         backend=make_backend())
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for chunks in STEPS:
        out, ref = run_layer(cache, chunks, history, dtype, gen)
        assert out.dtype == dtype
        assert out.shape == ref.shape
        assert (out.float() - ref).abs().max().item() <= tol, chunks


def test_cpu_backend_falls_back_for_head_sizes_without_a_kernel() -> None:
    """D = 24: the extension has no prefill kernel for it; PyTorch's path computes."""
    assert not cpu_backend()._ext.prefill_head_size_supported(24)
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, HKV, 24, num_blocks=48, block_size=4, backend=cpu_backend())
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for chunks in STEPS:
        out, ref = run_layer(cache, chunks, history, torch.float32, gen, d=24)
        assert (out - ref).abs().max().item() <= 1e-5, chunks


# Steps with long chunks: several key blocks of 64 and query items of 32 tokens, partial ones
# at every end, a chunk that continues a long context, and prefills beside decodes.
LONG_STEPS = [
    [(0, 150), (1, 1), (2, 33)],
    [(0, 70), (1, 1), (2, 1), (3, 64)],
    [(3, 65), (0, 1), (4, 129)],
    [(4, 2), (1, 300)],
]


@pytest.mark.parametrize("head_dim,hq,hkv", [(64, 9, 3), (32, 4, 1), (128, 4, 4), (16, 8, 2)])
@pytest.mark.parametrize("dtype,cache_dtype,tol", [
    (torch.float32, torch.float32, 2e-5),
    (torch.float32, torch.float16, 2e-5),  # fp32 activations over the CPU's fp16 cache
    (torch.bfloat16, torch.bfloat16, 3e-2),
])
def test_cpu_prefill_kernel_matches_dense_attention(head_dim: int, hq: int, hkv: int,
                                                    dtype: torch.dtype, cache_dtype: torch.dtype,
                                                    tol: float,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fallback(*args: object) -> None:
        raise AssertionError("the CPU backend fell back to PyTorch's prefill")

    monkeypatch.setattr(TorchAttentionBackend, "_prefill", no_fallback)
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(1, hkv, head_dim, num_blocks=160, block_size=16, dtype=cache_dtype,
                         backend=cpu_backend())
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for chunks in LONG_STEPS:
        out, ref = run_layer(cache, chunks, history, dtype, gen, hq, hkv, head_dim)
        assert out.dtype == dtype
        assert (out.float() - ref).abs().max().item() <= tol, chunks


def test_cpu_prefill_kernel_rejects_what_it_cannot_read() -> None:
    """Bad arguments to the kernel are errors naming the problem, never reads out of bounds."""
    ext = cpu_backend()._ext
    cache = torch.zeros(2, 4, 16, 1, 64)
    q = torch.zeros(10, 2, 64)
    out = torch.zeros(10, 128)
    tables = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="chunk 0 has rows"):
        ext.prefill_attention(q, cache, tables, [5, 10, 10, 0], 0.125, out)
    with pytest.raises(RuntimeError, match="block table row is out of range"):
        ext.prefill_attention(q, cache, tables, [0, 10, 100, 0], 0.125, out)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.prefill_attention(q, cache, torch.full((1, 4), 9, dtype=torch.int32),
                              [0, 10, 10, 0], 0.125, out)
    with pytest.raises(RuntimeError, match="head size 24 is not supported"):
        ext.prefill_attention(torch.zeros(10, 2, 24), torch.zeros(2, 4, 16, 1, 24), tables,
                              [0, 10, 10, 0], 0.125, torch.zeros(10, 48))


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
