"""Turns a SchedulerOutput into tensors, runs the model, samples, returns plain token ids."""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill import envs
from tokenmill.config import EngineConfig, LoRAConfig
from tokenmill.core.kv_cache import blocks_for_tokens
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.kernels.cpu import note_model_weights
from tokenmill.lora.manager import LoRAManager
from tokenmill.lora_request import LoRARequest
from tokenmill.models.config import ArchConfig
from tokenmill.models.pooler import PoolerConfig
from tokenmill.quant.model import linear_layer_names, model_weight_bytes
from tokenmill.quant.packing import dense_dtype
from tokenmill.runner.cpu_program import CpuProgram
from tokenmill.runner.cuda_graphs import DecodeGraphs, GraphCapture
from tokenmill.runner.flat_batch import FlatBatch
from tokenmill.runner.kv_memory import KVCacheShape
from tokenmill.runner.launched import LaunchedStep
from tokenmill.runner.platform import Platform
from tokenmill.runner.pooling import pool_embeddings
from tokenmill.runner.request_state import RequestState, SamplingState
from tokenmill.runner.sample_rows import sample_rows, verify_rows
from tokenmill.runner.sampler import (
    Sampler,
    compute_prompt_logprobs,
)
from tokenmill.runner.step_backend import (
    CpuProgramBackend,
    CudaGraphBackend,
    EagerBackend,
    InvariantCpuProgramBackend,
    ModelStep,
    StepBackend,
)
from tokenmill.runner.step_inputs import StepInputs, prepare_inputs
from tokenmill.runner.thinking import ThinkingTracker
from tokenmill.structured.matcher import GrammarState
from tokenmill.utils import host_tensor

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV tensors and the per-request sampling state."""

    def __init__(self, model: nn.Module, arch: ArchConfig, platform: Platform,
                 dtype: torch.dtype, block_size: int, eos_token_ids: frozenset[int],
                 enable_cpu_program: bool | None = None, deterministic: bool = False,
                 pooler: PoolerConfig | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.arch = arch
        self.platform = platform
        self.device = platform.device
        self.dtype = dtype
        self.block_size = block_size
        self.eos_token_ids = sorted(eos_token_ids)
        # How embedding requests are pooled; an encoder (no KV cache, no sampling) runs
        # nothing else.
        self.pooler = pooler or PoolerConfig("last")
        self.is_encoder = bool(getattr(model, "is_encoder", False))
        self.backend = platform.attention_backend()
        if self.device.type == "cpu":
            # Whether the CPU kernels stream this model's weights past the caches (by the
            # process's models' size against the last-level cache, or as
            # TOKENMILL_STREAM_WEIGHTS says); the model's bytes count while it lives.
            note_model_weights(model_weight_bytes(model), envs.TOKENMILL_STREAM_WEIGHTS,
                               owner=model)
        self.sampler = Sampler()
        # The last launched step's sampled ids on the device, and the requests of their rows:
        # the next step's input for a request whose token the host has not seen yet.
        self._last_sampled: tuple[torch.Tensor, list[RequestState]] | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, RequestState] = {}
        self.sampling_states: dict[str, SamplingState] = {}
        # This rank's share of the KV heads: each tensor-parallel rank caches its own heads.
        tp = getattr(model, "tp_size", 1)
        # The cache's dtype: the activations' unless told (see Platform.resolve_kv_cache_dtype).
        if kv_dtype == torch.float8_e4m3fn and self.backend.name != "triton":
            raise ValueError("an fp8 KV cache is read by the Triton attention kernels only; "
                             f"this engine's attention backend is {self.backend.name!r} "
                             "(is triton installed?)")
        self.kv_shape = KVCacheShape(arch.num_hidden_layers, block_size,
                                     arch.num_key_value_heads // tp, arch.head_dim,
                                     kv_dtype or dtype)
        # Deterministic: every step through the CPU program, each token its own sequence.
        self.deterministic = deterministic
        # How a step is computed: the engine's one step backend, picked now by the platform
        # (on CUDA the decode graphs replace it once captured), and model.forward for the
        # steps it does not support. enable_cpu_program None defers to the environment.
        self.eager = EagerBackend(model, marks_decode_steps=not self.is_encoder)
        self.step_backend: StepBackend = platform.step_backend(
            self.eager, deterministic=deterministic,
            cpu_program=enable_cpu_program, tensor_parallel_size=tp,
            is_encoder=self.is_encoder)
        if not platform.is_cuda or self.is_encoder:  # else when the graphs are decided
            logger.info("step backend: %s", self.step_backend.describe())
        # LoRA adapters' slots and rows (enable_lora); None: the base model only.
        self.lora: LoRAManager | None = None

    def enable_lora(self, config: LoRAConfig) -> None:
        """Wrap the model's projections in LoRA layers with ``config.max_loras`` slots (after
        the CPU program took the base weights: it keeps computing the base-only steps)."""
        if self.is_encoder:
            raise ValueError(f"LoRA adapters apply to decoder models; {self.arch.architecture} "
                             "is an encoder")
        # The adapters multiply as the projections do: in bf16 where every projection is an
        # int8/int4 one on a CPU that multiplies bf16 natively (half the bytes of fp32, and
        # oneDNN's faster products), else in the activations' dtype.
        slot_dtype = self.dtype
        if (self.device.type == "cpu" and not linear_layer_names(self.model)
                and dense_dtype("cpu") == torch.bfloat16):
            slot_dtype = torch.bfloat16
        self.lora = LoRAManager(self.model, self.arch, config, slot_dtype, self.device)
        if self.cpu_program is not None:
            self.cpu_program.attach_lora(self.lora.layers)

    @property
    def cpu_program(self) -> CpuProgram | None:
        """The CPU program of the step backend, None where the backend is another one."""
        return getattr(self.step_backend, "program", None)

    @cpu_program.setter
    def cpu_program(self, program: CpuProgram | None) -> None:
        """Swap the step backend for ``program``'s (None: eager): for tests and benchmarks
        that compare the paths on one engine."""
        if program is None:
            self.step_backend = self.eager
        elif self.deterministic:
            self.step_backend = InvariantCpuProgramBackend(program)
        else:
            self.step_backend = CpuProgramBackend(program)


    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The captured decode graphs (CUDA) where they are the step backend, else None."""
        return getattr(self.step_backend, "graphs", None)

    # ------------------------------------------------------------------------ KV memory

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes on this rank, over every layer."""
        return self.kv_shape.bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Give the runner a zeroed KV cache of ``num_blocks`` blocks."""
        self.kv_caches = self.kv_shape.allocate(num_blocks, self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer: copy-on-write of shared blocks."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)
        for cache in self.kv_caches:
            # As bytes: index_copy_ has no fp8 kernels, and a copy is the same for any dtype.
            raw = cache.view(torch.uint8)
            raw.index_copy_(1, dst, raw.index_select(1, src))

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """Run the biggest step the scheduler can ask for, to measure peak activation memory:
        one prompt of ``num_tokens`` tokens on a KV cache just large enough for it, and logits
        plus a softmax for ``num_seqs`` rows. The KV cache is released afterwards."""
        num_blocks = blocks_for_tokens(num_tokens, self.block_size)
        self.allocate_kv_cache(num_blocks)
        try:
            batch = FlatBatch(self.block_size)
            batch.add([0] * num_tokens, 0, list(range(1, num_blocks)))
            input_ids, positions, meta = batch.build(self.backend, self.kv_caches, self.device)
            hidden = self.model(input_ids, positions, meta)
            rows = torch.arange(min(num_seqs, num_tokens), device=self.device)
            self.model.compute_logits(hidden.index_select(0, rows)).softmax(-1)
            self.platform.synchronize()
        finally:
            self.kv_caches = []

    def capture_decode_graphs(self, max_batch_size: int, max_model_len: int,
                              capturer: GraphCapture | None = None) -> None:
        """Capture CUDA graphs of decode steps up to ``max_batch_size`` sequences (after the KV
        cache is allocated). ``capturer`` replaces the CUDA capture (tests on the CPU)."""
        graphs = DecodeGraphs(self.model, self.backend, self.kv_caches, self.block_size,
                              max_batch_size, max_model_len, self.device, capturer)
        prefetch = self._l2_prefetch() if capturer is None else None
        try:
            graphs.capture()
        finally:
            if prefetch is not None:  # its reads are in the small batches' graphs now
                prefetch.remove()
        self.step_backend = CudaGraphBackend(self.model, graphs)

    def _l2_prefetch(self):  # noqa: ANN202 - the module needs Triton: imported here only
        """The experimental L2 prefetch of the next matmul's weights in small batches' graphs
        (tokenmill/runner/l2_prefetch.py), when $TOKENMILL_L2_PREFETCH asks for it."""
        if self.device.type != "cuda" or not envs.TOKENMILL_L2_PREFETCH:
            return None
        from tokenmill.runner.l2_prefetch import L2Prefetch, prefetch_bytes_from_env

        max_bytes = prefetch_bytes_from_env()
        if not max_bytes:
            return None
        prefetch = L2Prefetch(self.model, max_bytes, torch.cuda.Stream(self.device))
        logger.info("L2 prefetch: %d MB of each next matmul's weight in decode graphs of up "
                    "to %d sequences", max_bytes >> 20, prefetch.max_batch)
        return prefetch

    # ------------------------------------------------------------------------ one step

    def execute(self, sched: SchedulerOutput,
                draft_probs: dict[str, torch.Tensor] | None = None) -> RunnerOutput:
        """Run one step of the model for the scheduled tokens and wait for its tokens.

        ``draft_probs`` are the distributions a draft model drew a request's draft tokens from
        (``[K, V]``, at least as many rows as drafts scheduled); requests without are verified
        as point-mass proposals.
        """
        return self.launch(sched, draft_probs).finish()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput,
               draft_probs: dict[str, torch.Tensor] | None = None) -> LaunchedStep:
        """Queue one step on the device and return before its sampled tokens are on the host
        (asynchronous scheduling: the engine schedules and launches the next step meanwhile,
        and :meth:`LaunchedStep.finish` waits for this one's tokens).

        A request whose last token is the previous launched step's sample, not yet on the
        host, takes it from the device (see ``_prepare_inputs``).
        """
        self._update_states(sched)
        if sched.kv_copies:
            self.copy_blocks(sched.kv_copies)
        if sched.is_empty:
            self._last_sampled = None
            return LaunchedStep(RunnerOutput())
        inputs = self._prepare_inputs(sched)
        if self.lora is not None:
            self.lora.begin_step(self._lora_runs(sched), inputs.input_ids.shape[0], self.device)
        try:
            hidden = self._forward(inputs)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        out = RunnerOutput()
        launched = LaunchedStep(out)
        if inputs.pool_spans:
            states = inputs.pool_states
            vectors = pool_embeddings(hidden, inputs.pool_spans, [s.pooling for s in states],
                                      self.pooler, getattr(self.model, "score_head", None))
            out.pooled = {s.request_id: v for s, v in zip(states, vectors, strict=True)}
        if inputs.prompt_lp_rows:
            self._prompt_logprobs(hidden, inputs, out)
        num_sampled = len(inputs.sample_rows)
        if num_sampled or inputs.spec.states:
            if inputs.samples_every_row:
                picked = hidden  # a decode-only step
            else:
                wanted = inputs.sample_rows + inputs.spec.rows
                picked = hidden.index_select(0, host_tensor(wanted, torch.int64, self.device))
            logits = self._compute_logits(picked)
            if num_sampled:
                launched.sampled, sampled_ids = sample_rows(
                    self.sampler, logits[:num_sampled], inputs.sample_states, self.device)
                self._last_sampled = (sampled_ids, inputs.sample_states)
            if inputs.spec.states:
                verify_rows(logits[num_sampled:].float(), inputs.spec, draft_probs or {}, out)
                launched.overlappable = False
        if launched.sampled is None:
            self._last_sampled = None
        return launched

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``model.compute_logits``, through the step backend (the CPU program's int8 head
        skips the module's Python on the way to the same kernel)."""
        return self.step_backend.logits(hidden)

    def _lora_runs(self, sched: SchedulerOutput) -> list[tuple[int, int, LoRARequest | None]]:
        """``(first row, row count, adapter)`` of each request of the step, in batch order
        (prepare_inputs lays each request's scheduled tokens out in this order)."""
        runs = []
        row = 0
        for rid, n in sched.num_scheduled_tokens.items():
            runs.append((row, n, self.requests[rid].lora))
            row += n
        return runs

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The step's hidden states: on the step backend where it supports the step, else
        ``model.forward``. An error of the backend's reaches the caller."""
        lora = self.lora.context.step if self.lora is not None else None
        step = ModelStep(inputs.input_ids, inputs.positions, inputs.attn_meta, lora)
        backend = self.step_backend
        return backend.forward(step) if backend.supports(step) else self.eager.forward(step)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
            self.sampling_states.pop(rid, None)
        for rid in sched.preempted_request_ids:
            self.requests.pop(rid, None)
        for new in sched.new_requests:
            params = new.sampling_params
            sampling = self.sampling_states.get(new.request_id)
            if sampling is None:
                generator = None
                if params.seed is not None:
                    generator = torch.Generator(self.device).manual_seed(params.seed)
                grammar = None if new.grammar is None else GrammarState(new.grammar)
                sampling = SamplingState(generator, grammar=grammar)
                if params.thinking_budget is not None:
                    sampling.thinking = ThinkingTracker(params.thinking_budget,
                                                        new.num_prompt_tokens)
                self.sampling_states[new.request_id] = sampling
            stop_ids = list(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids += self.eos_token_ids
            self.requests[new.request_id] = RequestState(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, params,
                list(new.block_ids), new.num_computed_tokens, sampling, stop_ids,
                new.pooling_params, new.lora_request)
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            if cached.block_ids is not None:
                state.block_ids = list(cached.block_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        inputs = prepare_inputs(sched, self.requests, self.block_size, self.backend,
                                self.kv_caches, self.device, self.is_encoder, self.deterministic)
        if inputs.in_flight[0]:
            self._fill_in_flight(inputs.input_ids, *inputs.in_flight)
        return inputs

    def _fill_in_flight(self, input_ids: torch.Tensor, rows: list[int],
                        request_ids: list[str]) -> None:
        """Copy the previous launched step's samples into ``rows`` of the input ids, on the
        device (queued behind that step: the host never waits for them)."""
        if self._last_sampled is None:
            raise RuntimeError("a token in flight, but the previous step sampled nothing")
        sampled, states = self._last_sampled
        index = {s.request_id: i for i, s in enumerate(states)}
        src = [index[rid] for rid in request_ids]
        n = len(rows)
        if rows == src == list(range(n)):  # a decode step after a decode step: the same order
            input_ids[:n].copy_(sampled[:n])
            return
        dst_t = host_tensor(rows, torch.int64, self.device)
        src_t = host_tensor(src, torch.int64, self.device)
        input_ids.index_copy_(0, dst_t, sampled.index_select(0, src_t))

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs,
                         out: RunnerOutput) -> None:
        for state, rows, targets, skipped in inputs.prompt_lp_rows:
            idx = torch.tensor(rows, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx))
            target_t = torch.tensor(targets, dtype=torch.int64, device=self.device)
            k = state.params.prompt_logprobs or 0
            lps = compute_prompt_logprobs(logits, target_t, k)
            out.prompt_logprobs[state.request_id] = [None] * skipped + lps

def capture_decode_graphs_if_enabled(runner: ModelRunner, config: EngineConfig,
                                     max_model_len: int) -> bool:
    """Capture the decode CUDA graphs where the configuration and the platform allow them
    (CUDA, not ``enforce_eager``, an attention backend that supports them); returns whether
    it did. Every tensor-parallel rank
    calls this at the same point, so captures meet in their all-reduces."""
    platform = runner.platform
    captures = platform.captures_decode_graphs(runner.backend, config.device.enforce_eager)
    if captures:
        max_bs = config.device.cuda_graph_max_batch_size or config.scheduler.max_num_seqs
        runner.capture_decode_graphs(max_bs, max_model_len)
    if platform.is_cuda and not runner.is_encoder:
        logger.info("step backend: %s", runner.step_backend.describe())
    return captures
