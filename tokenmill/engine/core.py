"""EngineCore: the scheduler and the KV block bookkeeping, with the executor that runs the model,
driven one step at a time.

The core talks to the executor through its public methods only, and does nothing with a
step's numbers itself: each model step becomes a StepStats, handed to the step consumers
registered on the core (compute, energy and cost accounting; heap trimming; whatever a caller
adds with :meth:`EngineCore.add_step_consumer`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache import KVCacheManager, NoKVCache
from tokenmill.core.kv_events import ZmqEventPublisher
from tokenmill.core.sched_output import EngineCoreOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.heap import HeapTrimmer
from tokenmill.executor import (
    Executor,
    ExecutorInfo,
    KVCachePlan,
    LaunchedStep,
    WeightTallies,
    make_executor,
)
from tokenmill.metrics.economics import EnergyMeter, StepAccountant, StepMeter
from tokenmill.metrics.stats import SchedulerStats, SpecDecodingStats, StepConsumer, StepStats
from tokenmill.model_loader import LoadedModel
from tokenmill.models.config import ArchConfig
from tokenmill.outputs import ComputeUsage
from tokenmill.request import Request, RequestStatus
from tokenmill.spec_decode.proposer import TargetModel, make_proposer

logger = logging.getLogger(__name__)


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
    # What one decode step reads of them: the memory roofline's bytes per token
    # (tokenmill.quant.model.decode_read_bytes).
    decode_read_bytes: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_backend: str
    # The decode CUDA graphs' batch sizes and longest context; () and 0 when there are none.
    decode_graph_sizes: tuple[int, ...]
    decode_graph_max_seq_len: int
    kv_cache: KVCachePlan


def resolve_task(task: str, arch: ArchConfig) -> str:
    """The engine's task: ``task``, with "auto" meaning "embed" for encoders; ValueError
    for generation with an encoder."""
    if task == "auto":
        return "embed" if arch.is_encoder else "generate"
    if task == "generate" and arch.is_encoder:
        raise ValueError(f"task 'generate' needs a decoder model; {arch.architecture} is an "
                         "encoder, which only gives embeddings (task 'embed')")
    return task


def usage_charger(scheduler: Scheduler) -> Callable[[str, ComputeUsage], None]:
    """Adds a step's share to a request's usage, unless the request finished since (asynchronous
    scheduling finishes a step after a stop or an abort may have ended it). It holds the
    scheduler, not the core: a cycle through the core would keep an engine frozen out of
    garbage collection (utils.freeze_startup_heap) alive after it is unloaded."""
    def charge(request_id: str, share: ComputeUsage) -> None:
        request = scheduler.requests.get(request_id)
        if request is not None:
            request.usage.add(share)

    return charge


class EngineCore:
    """Owns the scheduler and the executor; ``step()`` is one forward pass of the continuous
    batch.

    With ``tensor_parallel_size`` > 1 this process is rank 0 and the executor starts the other
    ranks; call :meth:`close` (or drop the engine) to stop them.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 executor: Executor | None = None) -> None:
        """``loaded``: a model already in memory (tests, tools) instead of ``config.model``;
        ``executor``: one made already (tests) instead of the one ``config`` asks for."""
        self.config = config
        self.executor = (executor if executor is not None
                         else make_executor(config, preloaded=loaded is not None))
        self.platform = self.executor.platform
        try:
            self._build(config, loaded)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        executor = self.executor
        loaded = executor.load_model(loaded)
        self.model_path = loaded.path
        self.quantization = loaded.quantization
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.task = resolve_task(config.model.task, self.arch)
        if self.arch.is_encoder and config.parallel.tensor_parallel_size > 1:
            raise ValueError("an encoder runs in one process: tensor_parallel_size must be 1")
        self.pooler = loaded.pooler
        self.max_model_len = self._resolve_max_model_len(config.model.max_model_len,
                                                         loaded.max_seq_length)
        sched_config = config.scheduler
        kv, captured = self._set_up_kv_cache(config)
        # Where the prefix cache's changes go after each step (None: nowhere; an encoder has
        # no cache, and leaves the endpoint to a model that has one).
        self.kv_events = (ZmqEventPublisher(
            config.cache.kv_events_endpoint,
            replay_endpoint=config.cache.kv_events_replay_endpoint)
                          if config.cache.kv_events_endpoint is not None
                          and not self.arch.is_encoder else None)
        if self.task == "embed" and sched_config.max_num_batched_tokens < self.max_model_len:
            # An embedding is computed in one step: any input up to max_model_len must fit.
            sched_config = dataclasses.replace(sched_config,
                                               max_num_batched_tokens=self.max_model_len)
        # How the executor runs the model, now that it is set up.
        self.executor_info: ExecutorInfo = executor.describe()
        self.dtype = self.executor_info.dtype
        if captured:
            logger.info("decode CUDA graphs captured for batch sizes %s",
                        list(self.executor_info.decode_graph_sizes))
        # (requests, tokens) the latest step computed, for batch-size metrics.
        self.last_batch: tuple[int, int] = (0, 0)
        logger.info(self.kv_plan.describe())
        self.proposer = make_proposer(config.speculative, TargetModel(
            model=loaded.model, arch=self.arch, model_config=config.model,
            platform=self.platform, dtype=self.dtype, block_size=config.cache.block_size,
            num_blocks=self.kv_plan.num_blocks, max_model_len=self.max_model_len))
        # Totals of speculative decoding; None when the engine does not speculate.
        self.spec_stats = SpecDecodingStats() if self.proposer is not None else None
        # Draft distributions of the drafts proposed for the next step (draft models only).
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.async_scheduling = self._resolve_async_scheduling(sched_config.async_scheduling)
        lora = config.lora
        self.scheduler = Scheduler(sched_config, kv, self.max_model_len,
                                   pipelined=self.async_scheduling,
                                   max_loras=lora.max_loras if lora.enable_lora else 0)
        # Adapters that unfinished requests run stay in host memory until they end.
        executor.keep_loras_in_use(self.scheduler.lora_in_use)
        logger.info("asynchronous scheduling: %s", "on" if self.async_scheduling else "off")
        # The step launched and not finished yet (asynchronous scheduling), with its schedule.
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._add_standard_consumers(config)

    def _set_up_kv_cache(self, config: EngineConfig) -> tuple[KVCacheManager, bool]:
        """Size and allocate the KV cache and capture the decode graphs (``self.kv_plan``);
        the block manager, and whether graphs were captured."""
        if self.arch.is_encoder:
            # An encoder computes each request whole in one step and attends only within it:
            # nothing outlives the step, so there is no KV cache to size or allocate.
            self.kv_plan = KVCachePlan(0, config.cache.block_size, 0, self.max_model_len)
            return NoKVCache(config.cache.block_size), False
        self.kv_plan = self.executor.plan_kv_cache(self.max_model_len)
        self.executor.allocate_kv_cache(self.kv_plan.num_blocks)
        captured = self.executor.capture_decode_graphs(self.max_model_len)
        kv = KVCacheManager(self.kv_plan.num_blocks, config.cache.block_size,
                            config.cache.enable_prefix_caching,
                            enable_kv_events=config.cache.kv_events_endpoint is not None)
        return kv, captured

    def _add_standard_consumers(self, config: EngineConfig) -> None:
        """The step meter, and the consumers every engine has: accounting and heap trimming."""
        econ = config.economics
        meter = EnergyMeter(econ.cpu_watts)
        # Times each step and reads its energy, for the StepStats.
        self._step_meter = StepMeter(meter)
        # What each step consumer gets, in order, when a step's tokens are back.
        self.step_consumers: list[StepConsumer] = []
        # Each step's time, energy and cost, shared out to its requests by tokens.
        self.accountant = StepAccountant(meter, econ.cost_per_hour,
                                         charge=usage_charger(self.scheduler))
        self.add_step_consumer(self.accountant)
        # The C heap's free pages back to the OS now and then (CPU engines, glibc).
        self._heap = HeapTrimmer.for_device(self.platform.is_cuda)
        if self._heap is not None:
            self.add_step_consumer(self._heap)

    def add_step_consumer(self, consumer: StepConsumer) -> None:
        """Call ``consumer`` with each model step's StepStats from now on (on the engine
        thread, when the step's tokens are back, after the consumers added before it)."""
        self.step_consumers.append(consumer)

    def _resolve_async_scheduling(self, asked: bool | None) -> bool:
        """Whether steps overlap (see SchedulerConfig.async_scheduling); ValueError when asked
        for where they cannot."""
        if self.task == "embed":
            return False  # each request is computed whole in one step: nothing to overlap
        blocker = None
        if self.proposer is not None:
            blocker = "speculative decoding (drafts are proposed from the tokens of the step)"
        elif self.config.parallel.tensor_parallel_size > 1:
            blocker = "tensor parallelism (the ranks run each step to its end together)"
        if asked is None:
            return blocker is None and self.platform.is_cuda
        if asked and blocker is not None:
            raise ValueError(f"async_scheduling cannot be used with {blocker}")
        return asked

    def close(self) -> None:
        """Stop the executor (the tensor-parallel workers, if any); idempotent. No step runs
        afterwards."""
        self.executor.close()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()

    def _resolve_max_model_len(self, asked: int | None, max_seq_length: int | None) -> int:
        model_max = self.arch.max_position_embeddings
        if asked is None:
            # A sentence-transformers folder's max_seq_length is the length it was trained
            # for (and the length sentence-transformers cuts inputs to).
            return min(model_max, max_seq_length or model_max)
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
        # A step still in flight needs no call of its own: each request it computes for is
        # in the scheduler until that step's update; when none is (all stopped or aborted
        # since), its tokens are dropped by whichever step() comes next.
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, and report each request's new tokens; then propose the
        next step's draft tokens when speculating.

        With asynchronous scheduling a call launches the next step first and then reports the
        tokens of the step launched by the call before, so the device runs one step while the
        host waits for the last one's tokens and turns them into outputs. A request that
        stops at step n has been scheduled in step n+1 too: that step's work for it is
        dropped. Steps whose tokens the next one needs on the host (grammars, penalties,
        min_tokens, top logprobs) finish before the next is scheduled.
        """
        outputs = self._step_overlapped() if self.async_scheduling else self._step_in_turn()
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv.take_events())
        return outputs

    def _step_in_turn(self) -> list[EngineCoreOutput]:
        """One step, scheduled, run and reported before the next is scheduled."""
        self._step_meter.start()
        sched = self.scheduler.schedule()
        self.last_batch = (len(sched.num_scheduled_tokens), sched.total_num_scheduled_tokens)
        runner_out = self.executor.execute(sched, self._draft_probs)
        self._step_done(sched)
        if self.spec_stats is not None:
            for rid, drafts in sched.scheduled_spec_decode_tokens.items():
                emitted = len(runner_out.sampled_token_ids.get(rid, ()))
                self.spec_stats.observe(len(drafts), max(emitted - 1, 0))
        outputs = self.scheduler.update(sched, runner_out)
        if self.proposer is not None:
            self._propose(sched)
        return outputs

    def _step_overlapped(self) -> list[EngineCoreOutput]:
        self._step_meter.start()
        previous, self._in_flight = self._in_flight, None
        outputs: list[EngineCoreOutput] = []
        if previous is not None and not previous[1].can_overlap:
            outputs = self._finish_step(*previous)
            previous = None
        sched = self.scheduler.schedule()
        self.last_batch = (len(sched.num_scheduled_tokens), sched.total_num_scheduled_tokens)
        launched = self.executor.launch(sched, self._draft_probs)
        if sched.is_empty:
            launched.finish()
        else:
            self._in_flight = (sched, launched)
        if previous is not None:
            outputs = self._finish_step(*previous)
        return outputs

    def _finish_step(self, sched: SchedulerOutput,
                     launched: LaunchedStep) -> list[EngineCoreOutput]:
        """Wait for a launched step's tokens and hand them to the scheduler."""
        runner_out = launched.finish()
        self._step_done(sched)
        return self.scheduler.update(sched, runner_out)

    def _step_done(self, sched: SchedulerOutput) -> None:
        """A step's tokens are back: hand its StepStats to every step consumer."""
        seconds, joules = self._step_meter.stop()
        stats = StepStats(num_scheduled_tokens=sched.num_scheduled_tokens,
                          batch_size=len(sched.num_scheduled_tokens),
                          num_batched_tokens=sched.total_num_scheduled_tokens,
                          seconds=seconds, energy_joules=joules,
                          energy_estimated=self._step_meter.estimated)
        for consume in self.step_consumers:
            consume(stats)

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

    @functools.cached_property
    def _weight_tallies(self) -> WeightTallies:
        """The model's parameter count, weight bytes and bytes a decode step reads: walks of
        every module, done once (the weights of an engine never change; a swap is a new
        engine), since the Ollama routes ask for them with each request."""
        return self.executor.weight_tallies()

    def model_info(self) -> ModelInfo:
        """The model, its weights and the KV cache as this engine (rank 0) holds them."""
        arch, info, weights = self.arch, self.executor_info, self._weight_tallies
        return ModelInfo(
            path=self.model_path, architecture=arch.architecture,
            quantization=self.quantization, dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.platform.device), max_model_len=self.max_model_len,
            vocab_size=arch.vocab_size, num_parameters=weights.num_parameters,
            weight_bytes=weights.weight_bytes, decode_read_bytes=weights.decode_read_bytes,
            num_hidden_layers=arch.num_hidden_layers,
            num_attention_heads=arch.num_attention_heads,
            num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
            attention_backend=info.attention_backend,
            decode_graph_sizes=info.decode_graph_sizes,
            decode_graph_max_seq_len=info.decode_graph_max_seq_len,
            kv_cache=self.kv_plan)

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.usage_total = self.accountant.totals.copy()
        if self.spec_stats is not None:
            stats.spec_decoding = self.spec_stats.copy()
        return stats
