"""Triton paged-attention kernels and backend against dense attention and the torch backend.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (fp32 and fp16; the
interpreter gets bf16 wrong, so bf16 is tested on CUDA only). With CUDA every test runs the
compiled kernels on the GPU.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from paged import PagedKVCache  # noqa: E402

from tokenmill.attention.backend import AttentionBackend, TorchAttentionBackend  # noqa: E402
from tokenmill.attention.metadata import AttentionMetadata  # noqa: E402
from tokenmill.kernels.tuning.decode_attention import DEFAULT_LAUNCH, parse_tuning  # noqa: E402
from tokenmill.models.layers import RotaryEmbedding, apply_rotary  # noqa: E402
from tokenmill.runner.flat_batch import FlatBatch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLS = {torch.float32: 1e-4, torch.float16: 1e-2}
# (Hq, Hkv, D, block_size): GQA groups of 4 and 3, power-of-two and padded head dims.
SHAPES = [(8, 2, 16, 4), (6, 2, 32, 16)]


@contextmanager
def interpreted_on_cpu() -> Iterator[None]:
    """Set TRITON_INTERPRET=1 for the block when there is no GPU, then restore it.

    Triton reads the variable when it is imported, when ``@triton.jit`` decorates a kernel,
    and again in some modules it imports at launch: so it is set around this module's imports
    and its tests, and nowhere else.
    """
    if DEVICE.type == "cuda":
        yield
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _import_triton_modules() -> tuple[ModuleType, ...]:
    """The kernels' and backend's modules, interpreted when there is no GPU."""
    triton = sys.modules.get("triton")
    if DEVICE.type == "cpu" and triton is not None and not triton.knobs.runtime.interpret:
        # Its own @triton.jit helpers (tl.sum, tl.max) were built for the compiler.
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set: run this "
                    "module on its own", allow_module_level=True)
    with interpreted_on_cpu():
        pytest.importorskip("triton")
        return tuple(importlib.import_module(name) for name in (
            "tokenmill.kernels.triton.attention", "tokenmill.kernels.triton.attention_decode",
            "tokenmill.kernels.triton.attention_prefill", "tokenmill.attention.triton_backend"))


kernels, decode, prefill, triton_backend = _import_triton_modules()


@pytest.fixture(autouse=True, scope="module")
def _interpret_while_testing() -> Iterator[None]:
    """Launches read the variable too (see :func:`interpreted_on_cpu`)."""
    with interpreted_on_cpu():
        yield


def new_cache(hkv: int, d: int, block_size: int, dtype: torch.dtype, num_blocks: int = 96,
              backend: AttentionBackend | None = None) -> PagedKVCache:
    """A one-layer shuffled paged cache on DEVICE."""
    cache = PagedKVCache(1, hkv, d, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                         backend=backend)
    cache.kv_caches = [t.to(DEVICE) for t in cache.kv_caches]
    return cache


def to_device(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata with its tensors on DEVICE (PagedKVCache builds them on the CPU)."""
    return replace(meta, slot_mapping=meta.slot_mapping.to(DEVICE),
                   query_start_loc=meta.query_start_loc.to(DEVICE),
                   seq_lens=meta.seq_lens.to(DEVICE), block_tables=meta.block_tables.to(DEVICE))


def fill(cache: PagedKVCache, lens: list[int], gen: torch.Generator) -> AttentionMetadata:
    """Give sequence ``i`` a context of ``lens[i]`` unit-scale random K/V (written by torch)."""
    meta = to_device(cache.step(list(enumerate(lens)))[0])
    kv = cache.kv_caches[0]
    _, _, _, hkv, d = kv.shape
    for i in range(2):
        new = torch.randn(len(meta.slot_mapping), hkv, d, generator=gen).to(kv)
        kv[i].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, new)
    return meta


def dense(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, query_lens: list[int],
          seq_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention in fp32, each context gathered from the cache: ``[T, Hq, D]``."""
    hq = q.shape[1]
    _, _, block_size, hkv, d = kv_cache.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for b, (n, total) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if total:
            blocks = tables[b, :-(-total // block_size)].long()
            k, v = (kv_cache[i][blocks].reshape(-1, hkv, d)[:total].float()
                    .repeat_interleave(hq // hkv, dim=1) for i in range(2))
            s = torch.einsum("qhd,khd->hqk", q[row:row + n].float(), k) * scale
            pos = torch.arange(total - n, total, device=q.device)
            causal = torch.arange(total, device=q.device)[None, :] <= pos[:, None]
            s = s.masked_fill(~causal, float("-inf"))
            out[row:row + n] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        row += n
    return out


def test_store_kv_writes_slots_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 8, 4, 2, 16, generator=gen).to(DEVICE)
    # A strided k, as the model passes it (a slice of a fused projection).
    kv = torch.randn(5, 4, 16, generator=gen).to(DEVICE)
    k, v = kv[:, :2], kv[:, 2:]
    slots = torch.tensor([9, -1, 0, 31, -1], device=DEVICE)
    expected = kv_cache.clone()
    keep = slots >= 0
    for i, x in enumerate((k, v)):
        expected[i].view(-1, 2, 16)[slots[keep]] = x[keep]
    kernels.store_kv(k, v, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


def rope_tables(positions: torch.Tensor, d: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.cos_sin``'s ``[T, 1, D]`` tables for ``positions``."""
    rope = RotaryEmbedding(d, 512, 10000.0, None)
    return rope.cos_sin(positions, dtype)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as the kernels compute it, op for op (``apply_rotary``'s addcmul
    may fuse a multiply-add): in fp32, rounded to x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[..., :half].float(), sin[..., half:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 16), (6, 2, 32), (4, 4, 80)])
def test_rotary_store_rotates_q_in_place_and_stores_k_rotated(
        hq: int, hkv: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype | None) -> None:
    """One kernel for the rotary embedding and the K/V store: q rotated in place, and the cache
    holding the same bytes as after rotating k and then :func:`store_kv` (an fp8 cache too:
    rounded to k's dtype first); padding slots write nothing; k is left alone."""
    gen = torch.Generator().manual_seed(5)
    n = 6
    # q, k and v as the model passes them: views of one fused projection.
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cos, sin = (t.to(DEVICE) for t in rope_tables(torch.tensor([0, 3, 7, 100, 1, 511]), d,
                                                  dtype))
    slots = torch.tensor([9, -1, 0, 31, 17, -1], device=DEVICE)
    kv_cache = torch.randn(2, 8, 4, hkv, d, generator=gen).to(cache_dtype or dtype).to(DEVICE)
    expected = kv_cache.clone()
    kernels.store_kv(rotated(k, cos, sin), v, expected, slots)
    want_q, k_before = rotated(q, cos, sin), k.clone()
    kernels.rotary_store_kv(q, k, v, kv_cache, slots, cos, sin)
    assert torch.equal(k, k_before)
    if DEVICE.type == "cpu":  # the interpreter: the same fp32 arithmetic as torch's
        assert torch.equal(q, want_q)
        assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    else:  # the compiled kernel may fuse a multiply-add: a rounding apart at most
        torch.testing.assert_close(q.float(), want_q.float(), rtol=2e-3, atol=2e-3)
        # (e4m3 keeps 3 bits of mantissa: one step is an eighth of the value)
        torch.testing.assert_close(kv_cache.float(), expected.float(), atol=2e-3,
                                   rtol=0.13 if cache_dtype else 2e-3)
    untouched = torch.ones(kv_cache[0].view(-1, hkv, d).shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    for i in range(2):
        assert torch.equal(kv_cache[i].view(-1, hkv, d)[untouched.to(DEVICE)].view(torch.uint8),
                           expected[i].view(-1, hkv, d)[untouched.to(DEVICE)].view(torch.uint8))


def test_rotary_store_rejects_an_odd_head_dim() -> None:
    q, k = torch.zeros(1, 2, 5, device=DEVICE), torch.zeros(1, 1, 5, device=DEVICE)
    cos = sin = torch.zeros(1, 1, 5, device=DEVICE)
    with pytest.raises(ValueError, match="even head dim"):
        kernels.rotary_store_kv(q, k, k, torch.zeros(2, 2, 4, 1, 5, device=DEVICE),
                                torch.zeros(1, dtype=torch.long, device=DEVICE), cos, sin)
    # The next call of a valid shape is served as before (nothing was left half done).
    q, k = torch.ones(1, 2, 4, device=DEVICE), torch.ones(1, 1, 4, device=DEVICE)
    cos, sin = torch.ones(1, 1, 4, device=DEVICE), torch.zeros(1, 1, 4, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 1, 4, device=DEVICE)
    kernels.rotary_store_kv(q, k, 2 * k, cache, torch.zeros(1, dtype=torch.long, device=DEVICE),
                            cos, sin)
    assert torch.equal(q, torch.ones_like(q))  # cos 1, sin 0: unrotated
    assert torch.equal(cache[0, 0, 0], k[0]) and torch.equal(cache[1, 0, 0], 2 * k[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,block_size", SHAPES + [(4, 4, 80, 16)])
def test_decode_matches_dense(hq: int, hkv: int, d: int, block_size: int,
                              dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = new_cache(hkv, d, block_size, dtype)
    # 1 and 16 tokens need one partition of 32, 300 needs ten; 0 is a padding row.
    lens = [300, 1, 0, 45, 16]
    meta = fill(cache, lens, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype).to(DEVICE)
    # A bound well past the longest context: most programs of the short rows have no keys.
    out = decode.decode_attention(q, cache.kv_caches[0], meta.block_tables, meta.seq_lens,
                                   d ** -0.5, max_seq_len=400, partition_size=32)
    ref = dense(q, cache.kv_caches[0], meta.block_tables, [1] * len(lens), lens, d ** -0.5)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() <= TOLS[dtype]
    assert not out[2].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_in_one_partition_writes_the_output_without_a_reduction(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """When one partition covers ``max_seq_len`` the split kernel writes the attention itself
    (zeros for padding rows) and the reduction is not launched: the same values as the
    combined path."""
    gen = torch.Generator().manual_seed(12)
    hq, hkv, d = 8, 2, 16
    cache = new_cache(hkv, d, 4, dtype)
    lens = [64, 1, 0, 33]
    meta = fill(cache, lens, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype).to(DEVICE)
    args = (q, cache.kv_caches[0], meta.block_tables, meta.seq_lens, d ** -0.5)
    combined = decode.decode_attention(*args, 64, partition_size=32)
    out = torch.full_like(q, float("nan"))  # every row written, the padding row too
    with monkeypatch.context() as patch:
        patch.setattr(decode, "_decode_reduce_kernel", None)  # launched: a TypeError
        decode.decode_attention(*args, 64, partition_size=64, block_n=32, out=out)
    ref = dense(q, cache.kv_caches[0], meta.block_tables, [1] * len(lens), lens, d ** -0.5)
    assert (out.float() - ref).abs().max().item() <= TOLS[dtype]
    assert not out[2].any()
    assert (combined.float() - out.float()).abs().max().item() <= TOLS[dtype]
    # With room for a second (empty) partition the same partitions are combined: the
    # reduction of one partition returns it unchanged.
    assert torch.equal(out, decode.decode_attention(*args, 128, partition_size=64, block_n=32))


@pytest.mark.parametrize("block_size,partition,block_n", [
    (4, 32, 16),    # eight blocks a partition, two tiles
    (16, 64, 32),   # the engine's blocks
    (16, 16, 16),   # one block, one tile
    (24, 64, 32),   # partitions that start inside a block: four blocks a partition
    (32, 16, 16),   # blocks longer than a partition
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_with_a_preloaded_table_matches_dense(block_size: int, partition: int,
                                                     block_n: int, dtype: torch.dtype) -> None:
    """``preload_table`` reads each partition's block ids once and gathers each tile's rows
    from them: the same keys as the per-tile reads, for any block size; a head dim of 24
    makes the cache's strides not multiples of 16 (no alignment hint)."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv = 4, 2
    for d in (16, 24):
        cache = new_cache(hkv, d, block_size, dtype)
        lens = [150, 1, 0, 23, 24, 25, 64]
        meta = fill(cache, lens, gen)
        q = torch.randn(len(lens), hq, d, generator=gen).to(dtype).to(DEVICE)
        args = (q, cache.kv_caches[0], meta.block_tables, meta.seq_lens, d ** -0.5, 200)
        launch = dict(partition_size=partition, block_n=block_n, num_warps=4, num_stages=3)
        out = decode.decode_attention(*args, **launch, preload_table=True)
        ref = dense(q, cache.kv_caches[0], meta.block_tables, [1] * len(lens), lens, d ** -0.5)
        assert (out.float() - ref).abs().max().item() <= TOLS[dtype], d
        if DEVICE.type == "cpu":  # the interpreter runs the same arithmetic on the same rows
            assert torch.equal(out, decode.decode_attention(*args, **launch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,block_size", SHAPES)
def test_prefill_matches_dense(hq: int, hkv: int, d: int, block_size: int,
                               dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    cache = new_cache(hkv, d, block_size, dtype)
    # Whole prompts, chunks after a cached prefix, and one-token rows.
    seq_lens = [70, 50, 9, 1, 33]
    query_lens = [70, 23, 1, 1, 8]
    meta = fill(cache, seq_lens, gen)
    q = torch.randn(sum(query_lens), hq, d, generator=gen).to(dtype).to(DEVICE)
    starts = torch.tensor([0, *query_lens], device=DEVICE).cumsum(0).to(torch.int32)
    out = prefill.prefill_attention(q, cache.kv_caches[0], meta.block_tables, starts,
                                    meta.seq_lens, d ** -0.5, query_lens)
    ref = dense(q, cache.kv_caches[0], meta.block_tables, query_lens, seq_lens, d ** -0.5)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= TOLS[dtype]


# (A chunk shorter than a 32-key tile is raised to one tile.)
@pytest.mark.parametrize("block_size,chunk", [(4, 16), (16, 32), (16, 64), (24, 32)])
def test_prefill_reads_the_context_a_chunk_at_a_time(block_size: int, chunk: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill kernel reads a chunk's block ids at once, then loops over the chunk's
    tiles: with chunks shorter than the contexts (and, at a block size of 24, chunks that
    start inside a block) it reads the same keys as with one chunk for every context."""
    gen = torch.Generator().manual_seed(13)
    hq, hkv, d = 8, 2, 16
    cache = new_cache(hkv, d, block_size, torch.float32)
    seq_lens = [70, 50, 9, 1, 33]
    query_lens = [70, 23, 1, 1, 8]
    meta = fill(cache, seq_lens, gen)
    q = torch.randn(sum(query_lens), hq, d, generator=gen).to(DEVICE)
    starts = torch.tensor([0, *query_lens], device=DEVICE).cumsum(0).to(torch.int32)
    args = (q, cache.kv_caches[0], meta.block_tables, starts, meta.seq_lens, d ** -0.5,
            query_lens)
    whole = prefill.prefill_attention(*args)  # one chunk of 512 covers every context here
    monkeypatch.setattr(prefill, "_PREFILL_CHUNK", chunk)
    out = prefill.prefill_attention(*args)
    ref = dense(q, cache.kv_caches[0], meta.block_tables, query_lens, seq_lens, d ** -0.5)
    assert (out - ref).abs().max().item() <= TOLS[torch.float32]
    if DEVICE.type == "cpu":  # the interpreter: the same arithmetic over the same keys
        assert torch.equal(out, whole)


def batch_step(cache: PagedKVCache, chunks: list[tuple[int, int]],
               split: tuple[int, int] | None = None) -> AttentionMetadata:
    """Metadata on DEVICE for a step adding ``(seq_id, n)`` tokens per sequence, then the
    ``split = (seq_id, n)`` tokens laid out as one-token sequences over the same blocks (how
    speculative tokens are verified)."""
    batch = FlatBatch(cache.block_size)
    parts = [(c, False) for c in chunks] + ([(split, True)] if split else [])
    for (seq_id, n), is_split in parts:
        start = cache.num_cached.get(seq_id, 0)
        table = cache.tables.setdefault(seq_id, [])
        while len(table) * cache.block_size < start + n:
            table.append(cache.free_blocks.pop())
        batch.add([0] * n, start, table, split=is_split)
        cache.num_cached[seq_id] = start + n
    return batch.build(cache.backend, cache.kv_caches, DEVICE)[2]


def compare_backends(triton_cache: PagedKVCache, torch_cache: PagedKVCache,
                     chunks: list[tuple[int, int]], split: tuple[int, int] | None, hq: int,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer step on twin caches: (triton output, torch output, dense reference)."""
    kv = triton_cache.kv_caches[0]
    _, _, _, hkv, d = kv.shape
    metas = [batch_step(c, chunks, split) for c in (triton_cache, torch_cache)]
    num_tokens = len(metas[0].slot_mapping)
    q = torch.randn(num_tokens, hq, d, generator=gen).to(kv)
    k, v = (torch.randn(num_tokens, hkv, d, generator=gen).to(kv) for _ in range(2))
    outs = [cache.backend.forward(q, k, v, cache.kv_caches[0], meta, d ** -0.5)
            for cache, meta in zip((triton_cache, torch_cache), metas, strict=True)]
    assert torch.equal(triton_cache.kv_caches[0], torch_cache.kv_caches[0])
    meta = metas[0]
    ref = dense(q, kv, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, d ** -0.5)
    return outs[0], outs[1], ref.view(num_tokens, hq * d)


def twin_caches(hkv: int, d: int, block_size: int, dtype: torch.dtype, num_blocks: int,
                partition_size: int) -> tuple[PagedKVCache, PagedKVCache]:
    """Identical caches, one for the Triton backend and one for the torch backend."""
    backend = triton_backend.TritonAttentionBackend(decode_partition_size=partition_size)
    tri = new_cache(hkv, d, block_size, dtype, num_blocks=num_blocks, backend=backend)
    ref = tri.clone()
    ref.backend = TorchAttentionBackend()
    return tri, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,block_size", SHAPES)
def test_backend_matches_torch_backend(hq: int, hkv: int, d: int, block_size: int,
                                       dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    tri, ref_cache = twin_caches(hkv, d, block_size, dtype, num_blocks=96, partition_size=32)
    assert tri.backend.name == "triton"
    steps: list[tuple[list[tuple[int, int]], tuple[int, int] | None]] = [
        ([(0, 7), (1, 1), (2, 13)], None),  # fresh prefills, one of a single token
        ([(0, 1), (1, 1), (2, 1)], None),  # decode only
        ([(0, 5), (1, 1), (3, 150), (2, 1)], None),  # continued chunk, decodes, a new prompt
        ([(3, 1)], None),  # a lone decode over five partitions
        ([(1, 6)], None),  # a lone continued chunk
        ([], (3, 3)),  # a split layout alone: decode-only
        ([(4, 20)], (0, 2)),  # a split layout beside a prompt: the prefill kernel
        ([(3, 1), (0, 1), (4, 1), (1, 1), (2, 1)], None),
    ]
    for chunks, split in steps:
        out, torch_out, ref = compare_backends(tri, ref_cache, chunks, split, hq, gen)
        assert out.dtype == dtype and out.shape == ref.shape
        assert (out.float() - ref).abs().max().item() <= TOLS[dtype], chunks
        assert (out.float() - torch_out.float()).abs().max().item() <= TOLS[dtype], chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_rotates_q_and_k_as_it_stores(dtype: torch.dtype) -> None:
    """``forward_rotary`` of unrotated q and k (what the model's attention layer passes the
    Triton backend) equals the torch backend's ``forward`` of q and k rotated by the model's
    :func:`apply_rotary`: the outputs, and the caches after prefills, decodes and a
    continued chunk."""
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d = 8, 2, 32
    tri, ref_cache = twin_caches(hkv, d, 4, dtype, num_blocks=64, partition_size=16)
    assert tri.backend.fuses_rotary and not ref_cache.backend.fuses_rotary
    for chunks in ([(0, 9), (1, 1)], [(0, 1), (1, 1)], [(1, 20), (0, 1)], [(0, 1), (1, 1)]):
        metas = [batch_step(c, chunks) for c in (tri, ref_cache)]
        n = len(metas[0].slot_mapping)
        positions = torch.cat([torch.arange(total - q, total) for q, total
                               in zip(metas[0].query_lens_cpu, metas[0].seq_lens_cpu,
                                      strict=True)])
        cos, sin = (t.to(DEVICE) for t in rope_tables(positions, d, dtype))
        qkv = torch.randn(n, hq + 2 * hkv, d, generator=gen).to(dtype).to(DEVICE)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        want = ref_cache.backend.forward(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin),
                                         v, ref_cache.kv_caches[0], metas[1], d ** -0.5)
        out = tri.backend.forward_rotary(q, k, v, tri.kv_caches[0], metas[0], d ** -0.5,
                                         cos, sin)
        assert (out.float() - want.float()).abs().max().item() <= TOLS[dtype], chunks
        stored = (tri.kv_caches[0].float() - ref_cache.kv_caches[0].float()).abs().max()
        assert stored.item() <= TOLS[dtype], chunks
    with pytest.raises(NotImplementedError, match="torch attention backend"):
        ref_cache.backend.forward_rotary(q, k, v, ref_cache.kv_caches[0], metas[1], 1.0, cos,
                                         sin)


def test_backend_padded_decode_as_in_a_cuda_graph() -> None:
    """Rows padded with slot -1 and seq_len 0, and a fixed bound on the lengths."""
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d = 8, 2, 16
    backend = triton_backend.TritonAttentionBackend(decode_partition_size=16)
    cache = new_cache(hkv, d, 4, torch.float32, backend=backend)
    fill(cache, [40, 3], gen)
    meta = to_device(cache.step([(0, 1), (1, 1)])[0])
    pad = 2
    padded = replace(
        meta,
        slot_mapping=torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)]),
        query_start_loc=torch.arange(3 + pad, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(pad)]),
        block_tables=torch.cat([meta.block_tables,
                                meta.block_tables.new_zeros(pad, meta.block_tables.shape[1])]),
        query_lens_cpu=[1] * (2 + pad), seq_lens_cpu=meta.seq_lens_cpu + [0] * pad,
        max_seq_len_bound=128)
    q = torch.randn(2 + pad, hq, d, generator=gen).to(DEVICE)
    k, v = (torch.randn(2 + pad, hkv, d, generator=gen).to(DEVICE) for _ in range(2))
    before = cache.kv_caches[0].clone()
    out = backend.forward(q, k, v, cache.kv_caches[0], padded, d ** -0.5)
    expected = before.clone()
    for i, x in enumerate((k, v)):
        expected[i].view(-1, hkv, d)[meta.slot_mapping] = x[:2]
    assert torch.equal(cache.kv_caches[0], expected)
    ref = dense(q[:2], cache.kv_caches[0], meta.block_tables, [1, 1], [41, 4], d ** -0.5)
    assert (out[:2] - ref.view(2, -1)).abs().max().item() <= 1e-4
    assert not out[2:].any()


def test_fp8_cache_stores_saturated_e4m3_and_both_kernels_read_it() -> None:
    """--kv-cache-dtype fp8: K and V are stored as e4m3 (values past +-448 clamped, never
    NaN), and prefill and decode attend over exactly what was stored, widened to the
    queries' dtype."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, block_size = 8, 2, 16, 4
    backend = triton_backend.TritonAttentionBackend(decode_partition_size=16)
    cache = new_cache(hkv, d, block_size, torch.float8_e4m3fn, backend=backend)
    kv = cache.kv_caches[0]
    for chunks in ([(0, 30), (1, 5)], [(0, 1), (1, 1)], [(1, 3), (0, 1)]):
        meta = to_device(cache.step(chunks)[0])
        n = len(meta.slot_mapping)
        q = torch.randn(n, hq, d, generator=gen).to(DEVICE)
        # Values fp8 holds exactly (Triton's interpreter rounds some others wrongly, e.g.
        # -7.84 to -4 where the GPU and torch give -8; the GPU test checks the rounding).
        k, v = ((torch.randn(n, hkv, d, generator=gen) * 3).to(torch.float8_e4m3fn)
                .float().to(DEVICE) for _ in range(2))
        k[0, 0, :2] = torch.tensor([1000.0, -5000.0])  # beyond fp8's range
        out = backend.forward(q, k, v, kv, meta, d ** -0.5)
        widened = kv.float()  # (indexing fp8 tensors directly is not supported everywhere)
        for i, x in enumerate((k, v)):
            stored = widened[i].view(-1, hkv, d)[meta.slot_mapping]
            assert torch.equal(stored, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
        assert not widened.isnan().any()
        ref = dense(q, widened, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu,
                    d ** -0.5)
        assert out.dtype == torch.float32
        assert (out - ref.view(n, -1)).abs().max().item() <= 1e-4, chunks


@pytest.mark.parametrize("fp8_compute", ["fp16", "query"])
def test_fp8_cache_widened_to_fp16_or_to_the_queries_dtype(fp8_compute: str) -> None:
    """An fp8 cache under 16-bit queries: the tuning's ``fp8_compute`` picks the dtype of the
    dot products (fp16, or the queries'); decode and prefill give dense attention over the
    stored values either way. (fp16 queries here: the interpreter gets bf16 wrong; the GPU
    test runs bf16.)"""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, block_size = 8, 2, 16, 4
    tuning = parse_tuning({"by_batch": [{"partition_size": 16}],
                           "by_batch_fp8": [{"partition_size": 16, "block_n": 16,
                                             "fp8_compute": fp8_compute}]}, "test")
    backend = triton_backend.TritonAttentionBackend(decode_tuning=tuning)
    cache = new_cache(hkv, d, block_size, torch.float8_e4m3fn, backend=backend)
    kv = cache.kv_caches[0]
    for chunks in ([(0, 37), (1, 6)], [(0, 1), (1, 1)]):
        meta = to_device(cache.step(chunks)[0])
        n = len(meta.slot_mapping)
        q = torch.randn(n, hq, d, generator=gen).half().to(DEVICE)
        k, v = ((torch.randn(n, hkv, d, generator=gen) * 2).to(torch.float8_e4m3fn)
                .half().to(DEVICE) for _ in range(2))
        out = backend.forward(q, k, v, kv, meta, d ** -0.5)
        ref = dense(q.float(), kv.float(), meta.block_tables, meta.query_lens_cpu,
                    meta.seq_lens_cpu, d ** -0.5)
        assert out.dtype == torch.float16
        assert (out.float() - ref.view(n, -1)).abs().max().item() <= 1e-2, chunks
    assert kernels.widens_to_fp16(q, kv, fp8_compute) == (fp8_compute == "fp16")
    assert not kernels.widens_to_fp16(q.float(), kv)  # fp32 queries keep exact products
    assert not kernels.widens_to_fp16(q, kv.half())  # not an fp8 cache


def test_backend_decodes_with_the_tuned_launch_of_its_batch_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step launches the tuning's settings for its batch size (the rule is picked
    by the number of rows, never by their lengths), and each setting computes the same
    attention."""
    tuning = parse_tuning({"by_batch": [
        {"max_batch": 2, "partition_size": 16, "block_n": 16, "num_warps": 4, "num_stages": 2,
         "max_registers": 128, "preload_table": True},
        {"max_batch": None, "partition_size": 64, "block_n": 32}]}, "test")
    launches: list[dict[str, object]] = []
    real = triton_backend.decode_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append({k: kwargs[k] for k in ("partition_size", "block_n", "num_warps",
                                                "num_stages", "max_registers",
                                                "preload_table")})
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    gen = torch.Generator().manual_seed(6)
    hq, hkv, d = 8, 2, 16
    backend = triton_backend.TritonAttentionBackend(decode_tuning=tuning)
    cache = new_cache(hkv, d, 4, torch.float32, backend=backend)
    fill(cache, [40, 3, 70], gen)
    for seqs in ([0, 1], [0, 1, 2]):
        meta = to_device(cache.step([(s, 1) for s in seqs])[0])
        q = torch.randn(len(seqs), hq, d, generator=gen).to(DEVICE)
        k, v = (torch.randn(len(seqs), hkv, d, generator=gen).to(DEVICE) for _ in range(2))
        out = backend.forward(q, k, v, cache.kv_caches[0], meta, d ** -0.5)
        ref = dense(q, cache.kv_caches[0], meta.block_tables, meta.query_lens_cpu,
                    meta.seq_lens_cpu, d ** -0.5)
        assert (out - ref.view(len(seqs), -1)).abs().max().item() <= 1e-4, seqs
    assert launches == [
        {"partition_size": 16, "block_n": 16, "num_warps": 4, "num_stages": 2,
         "max_registers": 128, "preload_table": True},
        {"partition_size": 64, "block_n": 32, "num_warps": 8, "num_stages": None,
         "max_registers": None, "preload_table": False}]
    # Without a tuning, a backend launches the defaults.
    assert triton_backend.TritonAttentionBackend().decode_tuning.for_batch(1) == DEFAULT_LAUNCH


def test_the_platform_reads_its_gpus_tuning_at_start_up(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The CUDA platform's backend carries the tuning of its GPU model; a bad tuning file is
    an error when the engine starts, not in the middle of a decode step."""
    from tokenmill.kernels.tuning import decode_attention as decode_tuning
    from tokenmill.runner.platform import Platform

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    decode_tuning.tuning_for_device.cache_clear()
    monkeypatch.delenv(decode_tuning.ENV_FILE, raising=False)
    try:
        backend = Platform(torch.device("cuda")).attention_backend()
        assert backend.name == "triton"
        assert backend.decode_tuning == decode_tuning.load_tuning(
            decode_tuning.TUNED_DIR / "nvidia-h200.json")
        decode_tuning.tuning_for_device.cache_clear()
        bad = tmp_path / "bad.json"
        bad.write_text('{"by_batch": [{"num_warps": 3}]}')
        monkeypatch.setenv(decode_tuning.ENV_FILE, str(bad))
        with pytest.raises(ValueError, match="num_warps must be 1, 2, 4, 8 or 16"):
            Platform(torch.device("cuda")).attention_backend()
    finally:
        decode_tuning.tuning_for_device.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_backend_matches_torch_backend_on_cuda_bf16() -> None:
    gen = torch.Generator().manual_seed(5)
    tri, ref_cache = twin_caches(8, 128, 16, torch.bfloat16, num_blocks=256, partition_size=512)
    for chunks in ([(0, 700), (1, 1), (2, 90)], [(0, 1), (1, 1), (2, 1)],
                   [(0, 40), (1, 1), (3, 1200)], [(3, 1), (0, 1)]):
        out, torch_out, ref = compare_backends(tri, ref_cache, chunks, None, 32, gen)
        assert (out.float() - ref).abs().max().item() <= 3e-2, chunks
        assert (out.float() - torch_out.float()).abs().max().item() <= 3e-2, chunks


def test_prefill_tiles_list_only_the_tiles_sequences_have() -> None:
    """A mixed step launches one program per (sequence, query tile) that has queries, not
    the longest chunk's tile count for every sequence."""
    # 8 query heads over 2 KV heads: groups of 4, so tiles of 64 rows hold 16 tokens.
    tiles = prefill.prefill_tiles([1, 40, 1, 17], 8, 2, torch.device("cpu"))
    assert tiles.tolist() == [[0, 1, 1, 1, 2, 3, 3], [0, 0, 1, 2, 0, 0, 1]]
    assert prefill.prefill_tiles([], 8, 2, torch.device("cpu")).shape == (2, 0)

