"""The CPU KV cache's default size: a share of free memory, capped, and never more than
max_num_seqs requests of max_model_len tokens need; explicit sizes always win."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.config import CacheConfig
from tokenmill.runner.kv_memory import CPU_DEFAULT_KV_BYTES_CAP, KVCacheShape, plan_kv_cache
from tokenmill.runner.platform import Platform

GIB = 1 << 30
BLOCK_BYTES = 1 << 20  # 1 MiB a block of 16 tokens


def test_cpu_cache_is_sized_to_the_workload() -> None:
    cpu = Platform(torch.device("cpu"))
    # 8 requests of 2,048 tokens: 8 x 128 blocks, though free memory would allow far more.
    plan = plan_kv_cache(CacheConfig(), cpu, BLOCK_BYTES, 2048, free_memory=100 * GIB,
                         max_num_seqs=8)
    assert plan.num_blocks == 8 * 128 + 1  # and the reserved null block
    # A partial last block counts whole.
    plan = plan_kv_cache(CacheConfig(), cpu, BLOCK_BYTES, 2050, free_memory=100 * GIB,
                         max_num_seqs=8)
    assert plan.num_blocks == 8 * 129 + 1


def test_memory_limits_still_apply_below_the_workload() -> None:
    cpu = Platform(torch.device("cpu"))
    # The workload would need 64 GiB: the cap decides.
    plan = plan_kv_cache(CacheConfig(), cpu, BLOCK_BYTES, 8192, free_memory=100 * GIB,
                         max_num_seqs=1024)
    assert plan.num_blocks == CPU_DEFAULT_KV_BYTES_CAP // BLOCK_BYTES
    # Little free memory: its fraction decides.
    plan = plan_kv_cache(CacheConfig(kv_cache_memory_fraction=0.5), cpu, BLOCK_BYTES, 8192,
                         free_memory=GIB, max_num_seqs=1024)
    assert plan.num_blocks == 512
    # A model sharing the budget with another gets its share, still no more than it needs.
    shared = CacheConfig(kv_cache_share=0.5)
    assert plan_kv_cache(shared, cpu, BLOCK_BYTES, 2048, free_memory=100 * GIB,
                         max_num_seqs=4).num_blocks == 4 * 128 + 1
    assert plan_kv_cache(shared, cpu, BLOCK_BYTES, 8192, free_memory=100 * GIB,
                         max_num_seqs=1024).num_blocks == CPU_DEFAULT_KV_BYTES_CAP // 2 // BLOCK_BYTES


def test_explicit_sizes_win_over_the_workload() -> None:
    cpu = Platform(torch.device("cpu"))
    plan = plan_kv_cache(CacheConfig(kv_cache_memory_bytes=3 * GIB), cpu, BLOCK_BYTES, 2048,
                         free_memory=100 * GIB, max_num_seqs=1)
    assert plan.num_blocks == 3 * 1024
    plan = plan_kv_cache(CacheConfig(num_blocks=5000), cpu, BLOCK_BYTES, 2048,
                         free_memory=100 * GIB, max_num_seqs=1)
    assert plan.num_blocks == 5000


def _resident_mib(t: torch.Tensor) -> float:
    """How much of the memory map that holds ``t`` is resident (its Rss in /proc/self/smaps):
    the map's own pages, whatever the rest of the process does meanwhile."""
    ptr = t.data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo <= ptr < hi
            elif inside and first == "Rss:":
                return int(line.split()[1]) / 1024
    raise AssertionError("no memory map holds the tensor")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc")
def test_the_cpu_cache_is_resident_only_as_it_fills() -> None:
    shape = KVCacheShape(num_layers=4, block_size=16, num_kv_heads=4, head_dim=64,
                         dtype=torch.float32)
    blocks = 1024  # per layer 2 x 1024 x 16 x 4 x 64 x 4 bytes = 128 MiB
    layers = shape.allocate(blocks, torch.device("cpu"))
    for t in layers:
        assert t.shape == (2, blocks, 16, 4, 64) and t.is_contiguous()
        assert t.data_ptr() % 64 == 0
        assert _resident_mib(t) < 4  # mapped, not written
    layers[0][:, :8].fill_(1.0)  # eight blocks of K and of V: 2 x 128 KiB written
    assert 0.2 < _resident_mib(layers[0]) < 8, _resident_mib(layers[0])
    assert _resident_mib(layers[1]) < 4
    assert layers[0][:, 8:].abs().sum() == 0 and layers[1].abs().sum() == 0
