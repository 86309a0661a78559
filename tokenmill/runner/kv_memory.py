"""The KV cache's memory: its tensors' layout and allocation, and how many blocks fit.

Every paged KV cache (the model runner's, a draft model's, the perplexity benchmark's) is one
tensor per layer holding K and V, ``[2, num_blocks, block_size, kv_heads, head_dim]``, made by
:meth:`KVCacheShape.allocate`. The engine's cache is sized by :func:`size_kv_cache`: explicit
blocks or bytes, what ``gpu_memory_utilization`` leaves after a profiling step on CUDA, else on
the CPU what the workload needs, capped by free memory and by the model's size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.core.kv_cache import blocks_for_tokens, tokens_in_blocks
from tokenmill.quant.model import model_weight_bytes
from tokenmill.runner.platform import Platform
from tokenmill.utils import cdiv, lazy_zeros

if TYPE_CHECKING:
    from tokenmill.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Without an explicit size, the CPU KV cache stays below this many bytes: zero-filling more
# costs start-up time and memory the CPU rarely has the compute to use.
CPU_DEFAULT_KV_BYTES_CAP = 4 << 30
# ... and below this many times the model's weights (but holds one whole request): a CPU
# decodes a small model's batch no faster than its weights allow, so a 100 MB model has no use
# for gigabytes of cache (llama.cpp and Ollama size theirs as a few contexts, the same scale).
CPU_KV_WEIGHTS_RATIO = 4


@dataclass(frozen=True)
class KVCacheShape:
    """The geometry of a paged KV cache: one K-and-V tensor per layer."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's KV heads (all of them without tensor parallelism)
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over every layer, K and V."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """Zeroed ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensors, one per layer."""
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if torch.device(device).type == "cpu":
            # Resident only as far as the cache is used (see lazy_zeros).
            return [lazy_zeros(shape, self.dtype) for _ in range(self.num_layers)]
        return [torch.zeros(shape, dtype=self.dtype, device=device)
                for _ in range(self.num_layers)]


@dataclass(frozen=True)
class KVCachePlan:
    """How the KV cache was sized; printed at start-up and by `tokenmill info`."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    dtype: str = ""  # how K and V are stored ("float16"); "" when there is no cache
    how: str = ""  # how the size was chosen (which option or limit decided)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_num_tokens(self) -> int:
        """Tokens the cache holds at once."""
        return tokens_in_blocks(self.num_blocks, self.block_size)

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens fit at once."""
        return self.max_num_tokens / self.max_model_len

    def describe(self) -> str:
        if self.num_blocks == 0:
            return "KV cache: none (an encoder computes each request whole in one step)"
        stored = f" in {self.dtype}" if self.dtype else ""
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.max_num_tokens} tokens ({self.total_bytes / 2**20:.0f} MiB{stored}); "
                f"max concurrency at {self.max_model_len} tokens per request: "
                f"{self.max_concurrency:.2f}x" + (f"; size {self.how}" if self.how else ""))


def plan_kv_cache(cache: CacheConfig, platform: Platform, bytes_per_block: int,
                  max_model_len: int, free_memory: int | None = None,
                  profiled_budget: int | None = None,
                  max_num_seqs: int | None = None,
                  weight_bytes: int | None = None) -> KVCachePlan:
    """Size the KV cache: explicit blocks, explicit bytes, ``profiled_budget`` bytes (on CUDA:
    what ``gpu_memory_utilization`` leaves after a profiling step, the tightest rank's under
    tensor parallelism), else on the CPU the least of (see :func:`cpu_default_kv_bytes`):
    what ``max_num_seqs`` requests of ``max_model_len`` tokens need, a fraction of free memory
    (``free_memory`` bytes when given, e.g. the tightest of several ranks, else the
    platform's), a few times the model's ``weight_bytes`` and a fixed ceiling. The plan says
    which of them decided."""
    if cache.num_blocks is not None:
        num_blocks, how = cache.num_blocks, "set by num_blocks (--num-kv-blocks)"
    elif cache.kv_cache_memory_bytes is not None:
        num_blocks = cache.kv_cache_memory_bytes // bytes_per_block
        how = "set by kv_cache_memory_bytes (--kv-cache-memory)"
    elif profiled_budget is not None:
        budget = int(profiled_budget * cache.kv_cache_share)
        how = (f"what gpu_memory_utilization={cache.gpu_memory_utilization} leaves"
               + (f" x a share of {cache.kv_cache_share:.2f}" if cache.kv_cache_share < 1 else ""))
        if cache.kv_cache_max_bytes is not None and cache.kv_cache_max_bytes < budget:
            budget, how = cache.kv_cache_max_bytes, "this model's part of the server's budget"
        num_blocks = budget // bytes_per_block
        how += "; --kv-cache-memory sets it"
    else:
        if free_memory is None:
            free_memory = platform.available_memory()
        budget, how = default_kv_bytes(cache, platform, bytes_per_block, max_model_len,
                                       free_memory, max_num_seqs, weight_bytes)
        num_blocks = budget // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache gets {num_blocks} blocks of {bytes_per_block} bytes; give it more "
            "memory (kv_cache_memory_bytes / num_blocks)")
    if num_blocks < blocks_for_tokens(max_model_len, cache.block_size):
        logger.warning("the KV cache (%d blocks) cannot hold one request of max_model_len=%d "
                       "tokens; such requests are rejected", num_blocks, max_model_len)
    return KVCachePlan(num_blocks, cache.block_size, bytes_per_block, max_model_len, how=how)


def default_kv_bytes(cache: CacheConfig, platform: Platform, bytes_per_block: int,
                     max_model_len: int, free_memory: int, max_num_seqs: int | None,
                     weight_bytes: int | None) -> tuple[int, str]:
    """The default KV size without a profiling step, and how it was chosen: the least of
    ``kv_cache_memory_fraction`` of ``free_memory`` (times ``kv_cache_share``), the server's
    ``kv_cache_max_bytes`` and, on the CPU, the workload (``max_num_seqs`` requests of
    ``max_model_len`` tokens), ``CPU_KV_WEIGHTS_RATIO`` times the weights (never less than one
    whole request: the floor) and ``CPU_DEFAULT_KV_BYTES_CAP``. A small model's cache would
    otherwise take gigabytes a CPU can never fill."""
    mib, share = 1 << 20, cache.kv_cache_share
    of_share = f" x share {share:.2f}" if share < 1 else ""
    fraction = cache.kv_cache_memory_fraction
    limits = [(int(free_memory * fraction * share),
               f"{fraction:.0%} of {free_memory / 2**30:.1f} GiB free{of_share}")]
    if cache.kv_cache_max_bytes is not None:
        limits.append((cache.kv_cache_max_bytes, "this model's part of the server's budget"))
    if not platform.is_cuda:
        limits.append((int(CPU_DEFAULT_KV_BYTES_CAP * share), f"the CPU ceiling{of_share}"))
        if max_num_seqs is not None:
            # Every request's own blocks, and the one reserved null block.
            need = (max_num_seqs * cdiv(max_model_len, cache.block_size) + 1) * bytes_per_block
            limits.append((need, f"{max_num_seqs} x {max_model_len} tokens"))
        if weight_bytes:
            one_request = (cdiv(max_model_len, cache.block_size) + 1) * bytes_per_block
            by_weights = CPU_KV_WEIGHTS_RATIO * weight_bytes
            limits.append((max(by_weights, one_request),
                           f"{CPU_KV_WEIGHTS_RATIO} x the {weight_bytes / mib:.0f} MiB of weights"
                           if by_weights >= one_request else
                           f"one request of {max_model_len} tokens (the floor)"))
    budget, why = min(limits, key=lambda limit: limit[0])
    among = ", ".join(f"{what} {size / mib:.0f} MiB" for size, what in limits)
    return budget, f"default: {why} (least of {among}); --kv-cache-memory sets it"


def profiled_kv_budget(runner: ModelRunner, config: EngineConfig,
                       max_model_len: int) -> int | None:
    """On CUDA without an explicit KV size: the bytes ``gpu_memory_utilization`` leaves for the
    KV cache after a profiling run of the largest step; None elsewhere. Every tensor-parallel
    rank calls this at the same point, so the profiling forward passes meet in their
    all-reduces."""
    cache, sched = config.cache, config.scheduler
    if (not runner.platform.is_cuda or cache.num_blocks is not None
            or cache.kv_cache_memory_bytes is not None):
        return None
    tokens = min(sched.max_num_batched_tokens, max_model_len)
    return runner.platform.kv_cache_budget(
        cache.gpu_memory_utilization, lambda: runner.profile_run(tokens, sched.max_num_seqs))


def size_kv_cache(runner: ModelRunner, config: EngineConfig, max_model_len: int,
                  min_over_ranks: Callable[[int], int], num_ranks: int) -> KVCachePlan:
    """The engine's KV cache plan, by the tightest of ``num_ranks`` ranks' memory
    (``min_over_ranks`` takes this rank's bytes and returns the least over all ranks).

    On CUDA without an explicit size, every rank first runs the profiling step (in lock step:
    its all-reduces pair up) to learn what ``gpu_memory_utilization`` leaves."""
    platform = runner.platform
    budget = profiled_kv_budget(runner, config, max_model_len)
    free = None
    if budget is not None:
        budget = min_over_ranks(budget)
    else:
        free = min_over_ranks(platform.available_memory())
        if not platform.is_cuda:
            free //= num_ranks  # the CPU ranks share one memory
    plan = plan_kv_cache(config.cache, platform, runner.kv_bytes_per_block(), max_model_len,
                         free_memory=free, profiled_budget=budget,
                         max_num_seqs=config.scheduler.max_num_seqs,
                         weight_bytes=model_weight_bytes(runner.model))
    return replace(plan, dtype=str(runner.kv_shape.dtype).removeprefix("torch."))
