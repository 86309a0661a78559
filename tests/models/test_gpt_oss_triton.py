"""Attention sinks (gpt-oss) in the Triton backend against the PyTorch backend and dense
attention, in fp32: prefill, continued chunks, decode over several partitions (the reduction
adds the sinks) and in one partition (the split kernel adds them), with and without a sliding
window. In Triton's interpreter on the CPU (TRITON_INTERPRET=1), on the GPU where there is one.

Run this module on its own where Triton was imported before it (as tests/unit's Triton tests).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from types import ModuleType

import pytest
import torch
from paged import PagedKVCache
from test_gpt_oss_attention import HKV, HQ, STEPS, D, dense_with_sinks

from tokenmill.attention.backend import TorchAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextmanager
def interpreted_on_cpu() -> Iterator[None]:
    """TRITON_INTERPRET=1 for the block when there is no GPU, restored after."""
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


def _triton_backend_module() -> ModuleType:
    triton = sys.modules.get("triton")
    if DEVICE.type == "cpu" and triton is not None and not triton.knobs.runtime.interpret:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set: run this "
                    "module on its own", allow_module_level=True)
    with interpreted_on_cpu():
        pytest.importorskip("triton")
        return importlib.import_module("tokenmill.attention.triton_backend")


triton_backend = _triton_backend_module()


@pytest.fixture(autouse=True, scope="module")
def _interpret_while_testing() -> Iterator[None]:
    with interpreted_on_cpu():
        yield


def to_device(meta: AttentionMetadata) -> AttentionMetadata:
    return replace(meta, slot_mapping=meta.slot_mapping.to(DEVICE),
                   query_start_loc=meta.query_start_loc.to(DEVICE),
                   seq_lens=meta.seq_lens.to(DEVICE), block_tables=meta.block_tables.to(DEVICE))


@pytest.mark.parametrize("partition", [16, 256], ids=["reduced", "one_partition"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_triton_sinks_match_torch_and_dense(window: int | None, partition: int) -> None:
    sinks = torch.tensor([2.5, -1.0, 0.3, 4.0, -3.0, 1.2, 0.0, 6.0])
    backend = triton_backend.TritonAttentionBackend(decode_partition_size=partition)
    tri = PagedKVCache(1, HKV, D, num_blocks=48, block_size=4, backend=backend)
    tri.kv_caches = [t.to(DEVICE) for t in tri.kv_caches]
    ref = tri.clone()
    ref.kv_caches = [t.cpu() for t in ref.kv_caches]
    ref.backend = TorchAttentionBackend()
    gen = torch.Generator().manual_seed(5)
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, chunks in enumerate([*STEPS, [(3, 14)], [(3, 1), (0, 1)]]):
        total = sum(n for _, n in chunks)
        q, k, v = (torch.randn(total, h, D, generator=gen) for h in (HQ, HKV, HKV))
        meta, _ = tri.step(chunks)
        ref_meta, _ = ref.step(chunks)
        got = backend.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), tri.kv_caches[0],
                              to_device(meta), D ** -0.5, window=window,
                              sinks=sinks.to(DEVICE)).cpu()
        want = ref.backend.forward(q, k, v, ref.kv_caches[0], ref_meta, D ** -0.5,
                                   window=window, sinks=sinks)
        dense, row = [], 0
        for seq_id, n in chunks:
            old_k, old_v = history.get(seq_id, (k[:0], v[:0]))
            history[seq_id] = (torch.cat([old_k, k[row:row + n]]),
                               torch.cat([old_v, v[row:row + n]]))
            dense.append(dense_with_sinks(q[row:row + n], *history[seq_id], old_k.shape[0],
                                          D ** -0.5, sinks, window))
            row += n
        assert (got - want).abs().max().item() <= 1e-4, f"step {i}"
        assert (got - torch.cat(dense)).abs().max().item() <= 1e-4, f"step {i}"
