"""EngineCore: the scheduler, the KV cache and the model runner, driven one step at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.sched_output import EngineCoreOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.distributed import unsharded
from tokenmill.distributed.executor import (
    TPExecutor,
    check_parallel_config,
    cpu_threads_per_rank,
    rank_device,
)
from tokenmill.metrics.stats import SchedulerStats, SpecDecodingStats
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.quant.model import count_parameters, model_weight_bytes
from tokenmill.request import Request, RequestStatus
from tokenmill.runner.model_runner import (
    ModelRunner,
    maybe_capture_decode_graphs,
    profiled_kv_budget,
)
from tokenmill.runner.platform import Platform, get_platform
from tokenmill.spec_decode.proposer import make_proposer
from tokenmill.utils import cdiv

logger = logging.getLogger(__name__)

# Without an explicit size, the CPU KV cache stays below this many bytes: zero-filling more
# costs start-up time and memory the CPU rarely has the compute to use.
CPU_DEFAULT_KV_BYTES_CAP = 4 << 30


@dataclass(frozen=True)
class KVCachePlan:
    """How the KV cache was sized; printed at start-up and by `tokenmill info`."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_num_tokens(self) -> int:
        """Tokens the cache holds at once (block 0 is reserved)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens fit at once."""
        return self.max_num_tokens / self.max_model_len

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.max_num_tokens} tokens ({self.total_bytes / 2**20:.0f} MiB); "
                f"max concurrency at {self.max_model_len} tokens per request: "
                f"{self.max_concurrency:.2f}x")


def plan_kv_cache(cache: CacheConfig, platform: Platform, bytes_per_block: int,
                  max_model_len: int, free_memory: int | None = None,
                  profiled_budget: int | None = None) -> KVCachePlan:
    """Size the KV cache: explicit blocks, explicit bytes, ``profiled_budget`` bytes (on CUDA:
    what ``gpu_memory_utilization`` leaves after a profiling step, the tightest rank's under
    tensor parallelism), else a fraction of free memory (``free_memory`` bytes when given,
    e.g. the tightest of several ranks, else the platform's)."""
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif cache.kv_cache_memory_bytes is None and profiled_budget is not None:
        num_blocks = profiled_budget // bytes_per_block
    else:
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if free_memory is None:
                free_memory = platform.available_memory()
            budget = int(free_memory * cache.kv_cache_memory_fraction)
            if not platform.is_cuda:
                budget = min(budget, CPU_DEFAULT_KV_BYTES_CAP)
        num_blocks = budget // bytes_per_block
    one_request = cdiv(max_model_len, cache.block_size) + 1
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache gets {num_blocks} blocks of {bytes_per_block} bytes; give it more "
            "memory (kv_cache_memory_bytes / num_blocks)")
    if num_blocks < one_request:
        logger.warning("the KV cache (%d blocks) cannot hold one request of max_model_len=%d "
                       "tokens; such requests are rejected", num_blocks, max_model_len)
    return KVCachePlan(num_blocks, cache.block_size, bytes_per_block, max_model_len)


@dataclass(frozen=True)
class ModelInfo:
    """What the engine runs, as plain data for front doors, tools and benchmarks."""

    path: str
    architecture: str
    quantization: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    device: str
    max_model_len: int
    vocab_size: int
    num_parameters: int
    weight_bytes: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_backend: str
    # The decode CUDA graphs' batch sizes and longest context; () and 0 when there are none.
    decode_graph_sizes: tuple[int, ...]
    decode_graph_max_seq_len: int
    kv_cache: KVCachePlan


class EngineCore:
    """Owns scheduler and runner; ``step()`` is one forward pass of the continuous batch.

    With ``tensor_parallel_size`` > 1 this process is rank 0: ``executor`` starts the other
    ranks and sends them each step; call :meth:`close` (or drop the engine) to stop them.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """``loaded``: a model already in memory (tests, tools) instead of ``config.model``."""
        self.config = config
        self.platform = get_platform(config.device.device)
        tp = config.parallel.tensor_parallel_size
        check_parallel_config(config, self.platform.device)
        if tp > 1 and loaded is not None:
            raise ValueError("a model loaded beforehand cannot be sharded: give config.model "
                             f"with tensor_parallel_size={tp}")
        num_threads = cpu_threads_per_rank(config.device.num_threads, tp)
        self.executor: TPExecutor | None = None
        if tp > 1:
            self.platform = Platform(rank_device(self.platform.device, 0))
            if self.platform.is_cuda:
                torch.cuda.set_device(self.platform.device)
            self.executor = TPExecutor(config, self.platform.device, num_threads)
        try:
            if self.executor is None:
                with unsharded():  # whole, even beside a tensor-parallel engine (tests)
                    self._build(config, loaded, num_threads)
            else:
                self._build(config, loaded, num_threads)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None,
               num_threads: int | None) -> None:
        self.platform.set_num_threads(num_threads)
        self.dtype = self.platform.resolve_dtype(config.model.dtype)
        if loaded is None:
            loaded = load_model(config.model, self.platform.device, self.dtype)
        self.model_path = loaded.path
        self.quantization = loaded.quantization
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.max_model_len = self._resolve_max_model_len(config.model.max_model_len)
        self.runner = ModelRunner(
            loaded.model, loaded.arch, self.platform, self.dtype, config.cache.block_size,
            self.tokenizer.eos_token_ids)
        self._allocate_kv_cache(config)
        if maybe_capture_decode_graphs(self.runner, config, self.max_model_len):
            logger.info("decode CUDA graphs captured for batch sizes %s",
                        self.runner.decode_graphs.sizes)  # type: ignore[union-attr]
        kv = KVCacheManager(self.kv_plan.num_blocks, config.cache.block_size,
                            config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, kv, self.max_model_len)
        # (requests, tokens) the latest step computed, for batch-size metrics.
        self.last_batch: tuple[int, int] = (0, 0)
        logger.info(self.kv_plan.describe())
        self.proposer = make_proposer(config.speculative, self)
        # Totals of speculative decoding; None when the engine does not speculate.
        self.spec_stats = SpecDecodingStats() if self.proposer is not None else None
        # Draft distributions of the drafts proposed for the next step (draft models only).
        self._draft_probs: dict[str, torch.Tensor] = {}

    def _allocate_kv_cache(self, config: EngineConfig) -> None:
        """Size the cache by the tightest rank's memory and give every rank one.

        On CUDA without an explicit size, every rank first runs the profiling step (in lock
        step: its all-reduces pair up) to learn what ``gpu_memory_utilization`` leaves."""
        if self.executor is not None:
            self.executor.wait_until_loaded()
        budget = profiled_kv_budget(self.runner, config, self.max_model_len)
        free = None
        if budget is not None and self.executor is not None:
            budget = self.executor.min_free_memory(budget)
        elif budget is None:
            free = self.platform.available_memory()
            if self.executor is not None:
                free = self.executor.min_free_memory(free)
                if not self.platform.is_cuda:
                    free //= self.executor.tp  # the CPU ranks share one memory
        self.kv_plan = plan_kv_cache(config.cache, self.platform,
                                     self.runner.kv_bytes_per_block(), self.max_model_len,
                                     free_memory=free, profiled_budget=budget)
        if self.executor is not None:
            self.executor.allocate_kv_cache(self.runner, self.kv_plan.num_blocks)
        else:
            self.runner.allocate_kv_cache(self.kv_plan.num_blocks)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent); no step runs afterwards."""
        if self.executor is not None:
            self.executor.close()

    def _resolve_max_model_len(self, asked: int | None) -> int:
        model_max = self.arch.max_position_embeddings
        if asked is None:
            return model_max
        if asked > model_max:
            raise ValueError(
                f"max_model_len={asked} is more than the model's context length {model_max}")
        return asked

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it can never run."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str] | set[str]) -> None:
        """Drop requests wherever they are; their KV blocks are freed at once."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str] | set[str]) -> None:
        """End requests whose output hit a stop string."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, and report each request's new tokens; then propose the
        next step's draft tokens when speculating."""
        sched = self.scheduler.schedule()
        self.last_batch = (len(sched.num_scheduled_tokens), sched.total_num_scheduled_tokens)
        if self.executor is not None:
            runner_out = self.executor.execute(self.runner, sched, self._draft_probs)
        else:
            runner_out = self.runner.execute(sched, self._draft_probs)
        if self.spec_stats is not None:
            for rid, drafts in sched.scheduled_spec_decode_tokens.items():
                emitted = len(runner_out.sampled_token_ids.get(rid, ()))
                self.spec_stats.observe(len(drafts), max(emitted - 1, 0))
        outputs = self.scheduler.update(sched, runner_out)
        if self.proposer is not None:
            self._propose(sched)
        return outputs

    def _propose(self, sched: SchedulerOutput) -> None:
        """Drafts for the running requests that decode (replacing any left unverified)."""
        assert self.proposer is not None
        self.proposer.finish(sched.finished_request_ids | sched.preempted_request_ids)
        candidates = [r for r in self.scheduler.running if r.sampling_params.speculative
                      and r.num_computed_tokens + 1 == r.num_tokens]
        proposals = self.proposer.propose(candidates) if candidates else {}
        self.scheduler.set_draft_tokens(
            {r.request_id: proposals[r.request_id].token_ids if r.request_id in proposals else []
             for r in candidates})
        self._draft_probs = {rid: p.probs for rid, p in proposals.items() if p.probs is not None}

    def model_info(self) -> ModelInfo:
        """The model, its weights and the KV cache as this engine (rank 0) holds them."""
        arch, runner = self.arch, self.runner
        graphs = runner.decode_graphs
        return ModelInfo(
            path=self.model_path, architecture=arch.architecture,
            quantization=self.quantization, dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.platform.device), max_model_len=self.max_model_len,
            vocab_size=arch.vocab_size, num_parameters=count_parameters(runner.model),
            weight_bytes=model_weight_bytes(runner.model),
            num_hidden_layers=arch.num_hidden_layers,
            num_attention_heads=arch.num_attention_heads,
            num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
            attention_backend=runner.backend.name,
            decode_graph_sizes=tuple(graphs.sizes) if graphs is not None else (),
            decode_graph_max_seq_len=graphs.max_seq_len if graphs is not None else 0,
            kv_cache=self.kv_plan)

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.spec_stats is not None:
            stats.spec_decoding = self.spec_stats.copy()
        return stats
