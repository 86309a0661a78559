"""Sliding-window attention (Gemma 3's local layers) in every backend against a dense
reference that masks by position: the PyTorch backend, the CPU one (whose C++ prefill kernel
has no window: windowed chunks take the PyTorch path) and the Triton kernels (run in Triton's
interpreter in fp32 on the CPU, compiled on a GPU). Prompts whole and in chunks, mixed steps,
decode-only steps whose context spans several decode partitions, some before the window."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from paged import PagedKVCache

from tokenmill.attention.backend import AttentionBackend, TorchAttentionBackend
from tokenmill.attention.cpu_backend import cpu_attention_backend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HQ, HKV, D = 4, 2, 16
# (seq id, new tokens) per step: prompts (shorter than, at and past the window) in one step,
# a step of chunks and decodes, then decode-only steps.
STEPS = [[(0, 5), (1, 30), (2, 70)], [(0, 1), (1, 9), (2, 1)], [(0, 1), (1, 1), (2, 1)],
         [(0, 1), (1, 1), (2, 1)]]


def dense(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
          query_lens: list[int], scale: float, window: int | None) -> torch.Tensor:
    """Attention of each sequence's queries (its last positions) over its whole context,
    causal and, with ``window``, over the last ``window`` positions only: ``[T, Hq * D]``."""
    out, row = [], 0
    for k, v, n in zip(keys, values, query_lens, strict=True):
        total = k.shape[0]
        qs = q[row:row + n].double()
        k, v = (x.double().repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
        s = torch.einsum("qhd,khd->hqk", qs, k) * scale
        pos = torch.arange(total - n, total)[:, None]
        cols = torch.arange(total)[None, :]
        keep = cols <= pos
        if window is not None:
            keep &= cols > pos - window
        s = s.masked_fill(~keep.to(s.device), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, HQ * D))
        row += n
    return torch.cat(out).float()


def run_steps(backend: AttentionBackend, window: int | None, block_size: int = 4
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(backend's output, dense reference) of each step of STEPS, for one layer."""
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, HKV, D, num_blocks=64, block_size=block_size, backend=backend)
    cache.kv_caches = [t.to(DEVICE) for t in cache.kv_caches]
    keys: dict[int, list[torch.Tensor]] = {}
    values: dict[int, list[torch.Tensor]] = {}
    for chunks in STEPS:
        meta, _ = cache.step(chunks)
        meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables = (
            t.to(DEVICE) for t in (meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                   meta.block_tables))
        t = sum(n for _, n in chunks)
        q, k, v = (torch.randn(t, h, D, generator=gen).to(DEVICE) for h in (HQ, HKV, HKV))
        row = 0
        for seq, n in chunks:
            keys.setdefault(seq, []).append(k[row:row + n])
            values.setdefault(seq, []).append(v[row:row + n])
            row += n
        want = dense(q, [torch.cat(keys[s]) for s, _ in chunks],
                     [torch.cat(values[s]) for s, _ in chunks], [n for _, n in chunks],
                     D ** -0.5, window)
        got = backend.forward(q, k, v, cache.kv_caches[0], meta, D ** -0.5, window=window)
        yield got.float().cpu(), want.cpu()


def _check(backend_of: Callable[[], AttentionBackend], window: int | None) -> None:
    for i, (got, want) in enumerate(run_steps(backend_of(), window)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=f"step {i}")


@pytest.mark.parametrize("window", [None, 1, 8, 20])
def test_torch_backend(window: int | None) -> None:
    _check(TorchAttentionBackend, window)


@pytest.mark.parametrize("window", [8, 20])
def test_cpu_backend(window: int) -> None:
    _check(cpu_attention_backend, window)


def test_the_reference_window_hides_keys() -> None:
    """The window changes the attention of positions past it (so the tests above can fail):
    the full and windowed outputs differ on the long prompt, agree on the short one."""
    full = list(run_steps(TorchAttentionBackend(), None))[0][0]
    windowed = list(run_steps(TorchAttentionBackend(), 8))[0][0]
    torch.testing.assert_close(windowed[:5 + 8], full[:5 + 8])
    assert (windowed[5 + 8:] - full[5 + 8:]).abs().max().item() > 1e-2


def test_a_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding window must be a positive number"):
        list(run_steps(TorchAttentionBackend(), 0))


def _triton_backend(partition: int) -> Callable[[], AttentionBackend]:
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA")
    pytest.importorskip("triton")
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    return lambda: TritonAttentionBackend(decode_partition_size=partition)


# A decode partition of 16 tokens: the 80-token context has five, the first ones wholly
# before a window of 8 or 20 (not written, not reduced); 128: one partition (no reduction).
@pytest.mark.parametrize("partition", [16, 128])
@pytest.mark.parametrize("window", [None, 8, 20])
def test_triton_kernels(window: int | None, partition: int) -> None:
    _check(_triton_backend(partition), window)


def test_triton_window_reaches_the_prefill_chunks(partition: int = 16) -> None:
    """A window longer than a prefill tile's keys and one shorter than a tile's queries (the
    kernel's loop then starts mid-context and rows see no key in its first tiles)."""
    for window in (1, 45):
        _check(_triton_backend(partition), window)
