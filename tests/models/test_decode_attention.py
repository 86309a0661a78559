"""The CPU decode attention (tokenmill/kernels/cpu/paged_attention.h) against a plain PyTorch softmax
over each sequence's gathered cache rows: every way its work is shared out (whole KV heads,
query heads one by one, a context cut between threads and merged), head sizes with and
without a grouped kernel, every cache dtype it takes."""

from __future__ import annotations

import pytest
import torch

BLOCK = 16


@pytest.fixture(scope="module")
def ext():  # noqa: ANN201
    from tokenmill.kernels.cpu import load_extension

    return load_extension()


@pytest.fixture
def threads():  # noqa: ANN201
    """Set torch's (and so the extension pool's) thread count for one test, then restore it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def make_case(lens: list[int], hq: int, hkv: int, d: int, cache_dtype: torch.dtype,
              q_dtype: torch.dtype = torch.float32, seed: int = 0):  # noqa: ANN201
    """Random queries, a cache whose blocks are handed out shuffled, and the block tables."""
    gen = torch.Generator().manual_seed(seed)
    need = [(n + BLOCK - 1) // BLOCK for n in lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[at:at + n], dtype=torch.int32)
        at += n
    cache = torch.randn(2, num_blocks, BLOCK, hkv, d, generator=gen).to(cache_dtype)
    q = torch.randn(len(lens), hq, d, generator=gen).to(q_dtype)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32)


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence and head, in float64."""
    hq, d = q.shape[1], q.shape[2]
    hkv = cache.shape[3]
    out = torch.empty(q.shape[0], hq * d, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        slots = [tables[b, t // BLOCK].item() * BLOCK + t % BLOCK for t in range(n)]
        k = cache[0].reshape(-1, hkv, d)[slots].double()  # [n, Hkv, D]
        v = cache[1].reshape(-1, hkv, d)[slots].double()
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).reshape(-1)
    return out


def run(ext, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,  # noqa: ANN001
        lens: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"), dtype=q.dtype)
    ext.decode_attention(q, cache, tables, lens, scale, out)
    return out


CASES = [
    # (lens, Hq, Hkv, D): the embedded model's shape at batch 1 and 2 (3 KV heads cut
    # between 2 threads), one KV head (cut in two), D = 128 (two passes of query heads per
    # KV head), contexts shorter than the threads, D = 16 (no grouped kernel), batch 32
    # (whole KV heads), no grouping (Hq = Hkv).
    ([560], 9, 3, 64),
    ([37, 300], 9, 3, 64),
    ([257], 8, 1, 64),
    ([130], 6, 2, 128),
    ([1], 9, 3, 64),
    ([2, 1, 3], 9, 3, 64),
    ([100], 4, 2, 16),
    ([17 + 3 * i for i in range(32)], 9, 3, 64),
    ([90, 33], 4, 4, 32),
]


@pytest.mark.parametrize("lens, hq, hkv, d", CASES)
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_matches_softmax_over_the_gathered_rows(ext, threads, lens, hq, hkv, d,  # noqa: ANN001
                                                num_threads) -> None:
    threads(num_threads)
    scale = d ** -0.5
    for cache_dtype in (torch.float32, torch.float16):
        q, cache, tables, seq_lens = make_case(lens, hq, hkv, d, cache_dtype)
        got = run(ext, q, cache, tables, seq_lens, scale)
        want = reference(q, cache, tables, seq_lens, scale)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_bf16_queries_over_a_bf16_cache(ext, threads) -> None:  # noqa: ANN001
    threads(2)
    q, cache, tables, seq_lens = make_case([600], 9, 3, 64, torch.bfloat16, torch.bfloat16)
    got = run(ext, q, cache, tables, seq_lens, 0.125)
    want = reference(q, cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=1e-2)


def test_threads_agree_with_one_thread(ext, threads) -> None:  # noqa: ANN001
    """Cutting a context between threads changes only the order of the sums."""
    q, cache, tables, seq_lens = make_case([777], 9, 3, 64, torch.float16, seed=5)
    threads(1)
    alone = run(ext, q, cache, tables, seq_lens, 0.125)
    threads(2)
    shared = run(ext, q, cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(shared, alone, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_named(ext) -> None:  # noqa: ANN001
    q, cache, tables, seq_lens = make_case([40], 4, 2, 32, torch.float32)
    out = torch.zeros(1, 4 * 32)
    with pytest.raises(RuntimeError, match="sequence 0 has 49 tokens"):
        ext.decode_attention(q, cache, tables, torch.tensor([49], dtype=torch.int32), 1.0, out)
    with pytest.raises(RuntimeError, match="sequence 0 has 0 tokens"):
        ext.decode_attention(q, cache, tables, torch.tensor([0], dtype=torch.int32), 1.0, out)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.decode_attention(q, cache, torch.full_like(tables, 99), seq_lens, 1.0, out)
    with pytest.raises(RuntimeError, match="seq_lens must be"):
        ext.decode_attention(q, cache, tables, seq_lens.long(), 1.0, out)
    with pytest.raises(RuntimeError, match="out must be"):
        ext.decode_attention(q, cache, tables, seq_lens, 1.0, torch.zeros(1, 3))
    with pytest.raises(RuntimeError, match="not supported"):
        ext.decode_attention(q.double(), cache.double(), tables, seq_lens, 1.0,
                             out.double())
    # The refused calls wrote nothing and changed nothing: the next good call is answered.
    torch.testing.assert_close(run(ext, q, cache, tables, seq_lens, 1.0).double(),
                               reference(q, cache, tables, seq_lens, 1.0), rtol=1e-4, atol=1e-5)
