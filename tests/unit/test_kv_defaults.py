"""Laptop-sized KV cache defaults on the CPU: the least of the workload, a fraction of free
memory, a few times the model's weights (at least one whole request) and a ceiling; a server's
default budget caps each model's default instead of replacing it; the plan says which limit
decided; explicit sizes still win."""

from __future__ import annotations

import torch

from tokenmill.cli import build_parser
from tokenmill.config import CacheConfig
from tokenmill.runner.kv_memory import (
    CPU_DEFAULT_KV_BYTES_CAP,
    CPU_KV_WEIGHTS_RATIO,
    plan_kv_cache,
)
from tokenmill.runner.platform import Platform
from tokenmill.server.model_registry import (
    default_specs,
    engine_configs,
    share_kv_budget,
)

GIB, MIB = 1 << 30, 1 << 20
# SmolLM2-135M: 30 layers x K and V x 3 KV heads x 64 dims x 2 bytes (fp16) x 16 tokens.
SMOL_BLOCK = 30 * 2 * 3 * 64 * 2 * 16
SMOL_WEIGHTS = 92 * MIB
CPU = Platform(torch.device("cpu"))


def test_a_small_model_gets_a_small_cache() -> None:
    """The embedded 92 MB model once got 4 GiB of KV cache on a machine with memory to spare."""
    plan = plan_kv_cache(CacheConfig(), CPU, SMOL_BLOCK, 8192, free_memory=64 * GIB,
                         max_num_seqs=64, weight_bytes=SMOL_WEIGHTS)
    assert plan.total_bytes <= CPU_KV_WEIGHTS_RATIO * SMOL_WEIGHTS
    assert plan.total_bytes > CPU_KV_WEIGHTS_RATIO * SMOL_WEIGHTS - SMOL_BLOCK
    assert plan.max_num_tokens >= 8192  # still room for a whole request, several in fact
    assert "x the 92 MiB of weights" in plan.how and "--kv-cache-memory" in plan.how
    assert "default: 4 x the 92 MiB of weights" in plan.describe()


def test_the_floor_is_one_whole_request() -> None:
    """Tiny weights, long context: one request of max_model_len still fits."""
    plan = plan_kv_cache(CacheConfig(), CPU, SMOL_BLOCK, 8192, free_memory=64 * GIB,
                         max_num_seqs=64, weight_bytes=1 * MIB)
    assert plan.max_num_tokens >= 8192 and plan.num_blocks == 8192 // 16 + 1
    assert plan.how.startswith("default: one request of 8192 tokens (the floor)"), plan.how


def test_free_memory_still_caps_it() -> None:
    plan = plan_kv_cache(CacheConfig(), CPU, SMOL_BLOCK, 8192, free_memory=1 * GIB,
                         max_num_seqs=64, weight_bytes=8 * GIB)
    assert plan.how.startswith("default: 20% of 1.0 GiB free"), plan.how
    assert plan.total_bytes <= GIB // 5


def test_the_workload_still_caps_it() -> None:
    plan = plan_kv_cache(CacheConfig(), CPU, SMOL_BLOCK, 256, free_memory=64 * GIB,
                         max_num_seqs=8, weight_bytes=8 * GIB)
    assert plan.how.startswith("default: 8 x 256 tokens"), plan.how
    assert plan.num_blocks == 8 * 16 + 1


def test_explicit_sizes_ignore_the_model_cap() -> None:
    plan = plan_kv_cache(CacheConfig(kv_cache_memory_bytes=2 * GIB), CPU, SMOL_BLOCK, 8192,
                         free_memory=64 * GIB, max_num_seqs=64, weight_bytes=SMOL_WEIGHTS)
    assert plan.num_blocks == 2 * GIB // SMOL_BLOCK and "--kv-cache-memory" in plan.how
    plan = plan_kv_cache(CacheConfig(num_blocks=7), CPU, SMOL_BLOCK, 64, free_memory=64 * GIB,
                         max_num_seqs=64, weight_bytes=SMOL_WEIGHTS)
    assert plan.num_blocks == 7 and "--num-kv-blocks" in plan.how


def test_the_server_budget_caps_the_default() -> None:
    cache = CacheConfig(kv_cache_max_bytes=100 * MIB)
    plan = plan_kv_cache(cache, CPU, SMOL_BLOCK, 8192, free_memory=64 * GIB,
                         max_num_seqs=64, weight_bytes=SMOL_WEIGHTS)
    assert plan.total_bytes <= 100 * MIB and "server's budget" in plan.how
    # Below the model's own default the cap changes nothing.
    roomy = plan_kv_cache(CacheConfig(kv_cache_max_bytes=3 * GIB), CPU, SMOL_BLOCK, 8192,
                          free_memory=64 * GIB, max_num_seqs=64, weight_bytes=SMOL_WEIGHTS)
    assert roomy.total_bytes <= CPU_KV_WEIGHTS_RATIO * SMOL_WEIGHTS


def test_the_default_server_does_not_hand_its_chat_model_the_whole_budget() -> None:
    """`tokenmill serve` with its two default models: the chat model's share of the budget
    was set as an explicit size, so the workload and model caps never applied."""
    args = build_parser().parse_args(["serve"])
    specs = default_specs(args)
    configs = share_kv_budget(engine_configs(args, specs), specs, None,
                              free_memory=64 * GIB, on_cuda=False)
    chat = configs[0].cache
    assert chat.kv_cache_memory_bytes is None
    assert chat.kv_cache_max_bytes == CPU_DEFAULT_KV_BYTES_CAP
    plan = plan_kv_cache(chat, CPU, SMOL_BLOCK, 8192, free_memory=64 * GIB,
                         max_num_seqs=configs[0].scheduler.max_num_seqs,
                         weight_bytes=SMOL_WEIGHTS)
    assert plan.total_bytes <= CPU_KV_WEIGHTS_RATIO * SMOL_WEIGHTS
    # --kv-cache-memory is still the size itself.
    args = build_parser().parse_args(["serve", "--kv-cache-memory", str(GIB)])
    configs = share_kv_budget(engine_configs(args, specs), specs, GIB, free_memory=64 * GIB,
                              on_cuda=False)
    assert configs[0].cache.kv_cache_memory_bytes == GIB


def test_free_memory_without_proc_or_avphys_pages(monkeypatch) -> None:
    """macOS has neither /proc/meminfo nor SC_AVPHYS_PAGES: half the physical memory."""
    import builtins
    import os

    from tokenmill.runner import platform

    real_open, real_sysconf = builtins.open, os.sysconf

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise OSError("no /proc here")
        return real_open(path, *args, **kwargs)

    def no_avphys(name):
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")
        return real_sysconf(name)

    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(os, "sysconf", no_avphys)
    total = real_sysconf("SC_PHYS_PAGES") * real_sysconf("SC_PAGE_SIZE")
    assert platform._host_available_memory() == total // 2
