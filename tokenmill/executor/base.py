"""The one interface between the engine and the model's ranks.

EngineCore keeps the scheduler; everything that runs the model goes through an
:class:`Executor`: load the model and build this process's ModelRunner, size and allocate
the KV cache (by the tightest rank's memory), capture decode graphs, run each step, stop.
What the engine needs to know or do beyond that goes through the executor's public methods
too (:meth:`Executor.describe`, :meth:`Executor.weight_tallies`, the LoRA methods): nothing
outside ``runner/`` but the executor that owns it touches the runner.
:class:`~tokenmill.executor.local.LocalExecutor` runs the whole model in this process,
:class:`~tokenmill.executor.tensor_parallel.TPExecutor` its shards on several processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.lora_request import LoRARequest
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.quant.model import count_parameters, decode_read_bytes, model_weight_bytes
from tokenmill.runner.kv_memory import KVCachePlan, size_kv_cache
from tokenmill.runner.launched import LaunchedStep
from tokenmill.runner.model_runner import ModelRunner, capture_decode_graphs_if_enabled
from tokenmill.runner.platform import Platform


@dataclass(frozen=True)
class ExecutorInfo:
    """How this process runs the model, as plain data: read once the executor is set up
    (after :meth:`Executor.capture_decode_graphs`, or :meth:`Executor.load_model` for an
    encoder, which has no KV cache)."""

    dtype: torch.dtype  # the dtype the model computes in
    attention_backend: str  # the attention backend's name, e.g. "torch" or "triton"
    # The decode CUDA graphs' batch sizes and longest context; () and 0 when there are none.
    decode_graph_sizes: tuple[int, ...] = ()
    decode_graph_max_seq_len: int = 0


@dataclass(frozen=True)
class WeightTallies:
    """This process's weights: parameters, bytes, and the bytes one decode step reads of them
    (the memory roofline's bytes per token; see tokenmill.quant.model)."""

    num_parameters: int
    weight_bytes: int
    decode_read_bytes: int


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
        """This process's ModelRunner (rank 0's shard under tensor parallelism), for the
        executor itself and for tests that look inside it; the engine uses the methods."""
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

    def describe(self) -> ExecutorInfo:
        """How this process runs the model (see :class:`ExecutorInfo`); call it once set up."""
        runner = self.runner
        graphs = runner.decode_graphs
        return ExecutorInfo(
            dtype=runner.dtype, attention_backend=runner.backend.name,
            decode_graph_sizes=tuple(graphs.sizes) if graphs is not None else (),
            decode_graph_max_seq_len=graphs.max_seq_len if graphs is not None else 0)

    def weight_tallies(self) -> WeightTallies:
        """Count this process's weights: a walk of every module (callers keep the answer; the
        weights of an engine never change)."""
        model = self.runner.model
        return WeightTallies(count_parameters(model), model_weight_bytes(model),
                             decode_read_bytes(model))

    def local_model(self) -> nn.Module:
        """The model this process runs (rank 0's shard under tensor parallelism), for tools
        that look at its modules; the engine steps it through :meth:`execute` only."""
        return self.runner.model

    def keep_loras_in_use(self, in_use: Callable[[int], bool]) -> None:
        """Keep in host memory every adapter for which ``in_use(lora_int_id)`` is true (the
        scheduler's: an unfinished request runs it); nothing to keep without LoRA."""
        if self.runner.lora is not None:
            self.runner.lora.store.in_use = in_use

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (its first request would otherwise): ValueError
        naming what is wrong with it, or when the engine runs no adapters."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: this engine runs no "
                             "LoRA adapters (start it with enable_lora / --enable-lora)")
        lora.store.get(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its requests still running keep it); whether it was held."""
        lora = self.runner.lora
        return False if lora is None else lora.remove(lora_int_id)

    def list_loras(self) -> list[int]:
        """The ids of the adapters held in host memory."""
        lora = self.runner.lora
        return [] if lora is None else lora.store.ids()

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
