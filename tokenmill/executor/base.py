"""The one interface between the engine and the model's ranks.

EngineCore keeps the scheduler; everything that runs the model goes through an
:class:`Executor`: load the model and build this process's ModelRunner, size and allocate
the KV cache (by the tightest rank's memory), capture decode graphs, run each step, stop.
:class:`~tokenmill.executor.local.LocalExecutor` runs the whole model in this process,
:class:`~tokenmill.executor.tensor_parallel.TPExecutor` its shards on several processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.runner.kv_memory import KVCachePlan, size_kv_cache
from tokenmill.runner.launched import LaunchedStep
from tokenmill.runner.model_runner import ModelRunner, capture_decode_graphs_if_enabled
from tokenmill.runner.platform import Platform


def load_runner(config: EngineConfig, platform: Platform,
                loaded: LoadedModel | None = None) -> tuple[LoadedModel, ModelRunner]:
    """Load this process's model as ``config`` says (or take ``loaded``, already in memory)
    and build its ModelRunner on ``platform``: the same on every rank."""
    dtype = platform.resolve_dtype(config.model.dtype)
    if loaded is None:
        loaded = load_model(config.model, platform.device, dtype)
    kv_dtype = platform.resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype,
                                               loaded.quantization != "none")
    runner = ModelRunner(loaded.model, loaded.arch, platform, dtype, config.cache.block_size,
                         loaded.tokenizer.eos_token_ids, deterministic=config.deterministic,
                         pooler=loaded.pooler, kv_dtype=kv_dtype)
    if config.lora.enable_lora:
        runner.enable_lora(config.lora)
    return loaded, runner


class Executor(ABC):
    """Runs the engine's model on ``num_ranks`` ranks; this process is rank 0.

    Call in this order: :meth:`load_model`, :meth:`plan_kv_cache`, :meth:`allocate_kv_cache`,
    :meth:`capture_decode_graphs`, then :meth:`execute` each step; :meth:`close` at the end
    (or on failure). Every rank takes the same steps at the same points, so their
    collectives pair up.
    """

    def __init__(self, config: EngineConfig, platform: Platform, num_threads: int | None,
                 num_ranks: int) -> None:
        self.config = config
        self.platform = platform  # this process's (rank 0's) device
        self.num_threads = num_threads
        self.num_ranks = num_ranks
        self._runner: ModelRunner | None = None

    @property
    def runner(self) -> ModelRunner:
        """This process's ModelRunner (rank 0's shard under tensor parallelism)."""
        if self._runner is None:
            raise RuntimeError("the executor has no runner before load_model()")
        return self._runner

    def load_model(self, loaded: LoadedModel | None = None) -> LoadedModel:
        """Load this process's model (or take ``loaded``, already in memory) and build its
        runner; returns the model as loaded."""
        self.platform.set_num_threads(self.num_threads)
        self.platform.set_kernel_spin_us(self.config.device.kernel_spin_us)
        loaded, self._runner = load_runner(self.config, self.platform, loaded)
        return loaded

    def plan_kv_cache(self, max_model_len: int) -> KVCachePlan:
        """Size the KV cache by the tightest rank's memory, once every rank has its model."""
        self.wait_until_loaded()
        return size_kv_cache(self.runner, self.config, max_model_len, self.min_free_memory,
                             self.num_ranks)

    def capture_decode_graphs(self, max_model_len: int) -> bool:
        """Capture the decode CUDA graphs where they apply (after :meth:`allocate_kv_cache`);
        returns whether it did. The other ranks capture theirs at the same point."""
        return capture_decode_graphs_if_enabled(self.runner, self.config, max_model_len)

    @abstractmethod
    def wait_until_loaded(self) -> None:
        """Return once every rank has loaded its model."""

    @abstractmethod
    def min_free_memory(self, local_free: int) -> int:
        """The least of ``local_free`` (this rank's bytes) over the ranks."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Give every rank a KV cache of ``num_blocks`` blocks (of its own KV heads)."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput,
                draft_probs: dict[str, torch.Tensor]) -> RunnerOutput:
        """Run one step on every rank; rank 0's output (see ModelRunner.execute)."""

    def launch(self, sched: SchedulerOutput,
               draft_probs: dict[str, torch.Tensor]) -> LaunchedStep:
        """Queue one step and return before its tokens are on the host where the executor can
        (see ModelRunner.launch); here, the whole step, run by :meth:`execute`, which the next
        step does not overlap."""
        return LaunchedStep(self.execute(sched, draft_probs), overlappable=False)

    @abstractmethod
    def close(self) -> None:
        """Stop whatever the executor started; idempotent. No step runs afterwards."""
