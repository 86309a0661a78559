"""The CPU KV cache's default size: a share of free memory, capped, and never more than
max_num_seqs requests of max_model_len tokens need; explicit sizes always win."""

from __future__ import annotations

import torch

from tokenmill.config import CacheConfig
from tokenmill.runner.kv_memory import CPU_DEFAULT_KV_BYTES_CAP, plan_kv_cache
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
