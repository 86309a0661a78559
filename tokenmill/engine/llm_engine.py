"""LLMEngine: prompts in, RequestOutputs out. Tokenizes, fans out n > 1, detokenizes."""

from __future__ import annotations

import dataclasses
import time

from tokenmill.config import EngineConfig
from tokenmill.core.beam_search import beam_search_request
from tokenmill.engine.core import EngineCore, ModelInfo
from tokenmill.engine.output_processor import OutputKind, OutputProcessor
from tokenmill.engine.pooling import EMBEDDING_SAMPLING, EmbeddingRequests, embedding_prompt
from tokenmill.lora_request import LoRARequest
from tokenmill.metrics.stats import SchedulerStats
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.request import Request, first_invalid_token_id
from tokenmill.sampling_params import MAX_SEED, PoolingParams, SamplingParams
from tokenmill.structured.compiler import GrammarCompiler

# A prompt is text, token ids, or {"prompt": text, "prompt_token_ids": ids} (either key).
PromptType = str | list[int] | dict


class LLMEngine:
    """The synchronous engine every front door drives: add requests, call ``step()``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        # Structured outputs' grammars, compiled on the caller's thread (cached by source).
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        self.embeddings = EmbeddingRequests()

    @property
    def task(self) -> str:
        """"generate" (text) or "embed" (pooled embeddings of whole prompts)."""
        return self.core.task

    @property
    def embedding_size(self) -> int:
        """Entries of a full embedding (the model's hidden size)."""
        return self.core.arch.hidden_size

    @property
    def cross_encoder(self) -> bool:
        """A cross-encoder (reranker): it scores pairs of texts read together, and its
        "embedding" of a pair's prompt is the pair's score."""
        return self.core.arch.is_cross_encoder

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def model_path(self) -> str:
        """The file or folder the weights came from (a preset's name for dummy weights)."""
        return self.core.model_path

    def model_info(self) -> ModelInfo:
        """The model, its weights, device and KV cache, as plain data."""
        return self.core.model_info()

    def stats(self) -> SchedulerStats:
        """A snapshot of the scheduler: queues, KV usage, prefix-cache and speculation totals."""
        return self.core.stats()

    @property
    def last_batch(self) -> tuple[int, int]:
        """(requests, tokens) the latest step computed."""
        return self.core.last_batch

    def unfinished_request_ids(self) -> list[str]:
        """Requests added and not yet finished or aborted (the ids given to ``add_request``)."""
        return list(self.processor.parents) + list(self.embeddings.pending)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent)."""
        self.grammars.close()
        self.core.close()

    def compile_grammar(self, params: SamplingParams) -> object | None:
        """The compiled grammar of ``params.structured_outputs`` (None without one); a
        ValueError (``GrammarError``) names what is wrong with it. Cached by source, so calling
        it before ``add_request`` (e.g. on another thread) makes that call cheap."""
        spec = params.structured_outputs
        return None if spec is None else self.grammars.compile(spec)

    @property
    def vocab_size(self) -> int:
        """Ids the model scores: every valid token id is below this."""
        return self.core.arch.vocab_size

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids given directly) and token ids, validated."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"unknown prompt field(s): {sorted(unknown)}")
            text = prompt.get("prompt")
            if "prompt_token_ids" not in prompt:
                return self.encode_prompt(text if isinstance(text, str) else "")
            return text, self.encode_prompt(prompt["prompt_token_ids"])[1]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.vocab_size
        bad = first_invalid_token_id(prompt, vocab)
        if bad is not None:
            raise ValueError(f"prompt token id at index {bad} must be an integer in [0, {vocab}), "
                             f"got {prompt[bad]!r}")
        return None, list(prompt)

    # ------------------------------------------------------------------ LoRA adapters

    @property
    def lora_enabled(self) -> bool:
        return self.config.lora.enable_lora

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (its first request would otherwise): ValueError
        naming what is wrong with it, or when the engine runs no adapters."""
        self.core.executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its requests still running keep it); whether it was held."""
        return self.core.executor.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        """The ids of the adapters held in host memory."""
        return self.core.executor.list_loras()

    # ----------------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams,
                    kind: OutputKind = OutputKind.FINAL_ONLY,
                    arrival_time: float | None = None, grammar: object | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; ValueError names what is wrong and nothing is queued.

        ``PoolingParams`` make an embedding request (task "embed" only): it finishes with one
        EmbeddingRequestOutput. A request with ``structured_outputs`` has its grammar
        compiled here unless ``grammar`` (from :meth:`compile_grammar`) is given.
        ``lora_request``: the LoRA adapter it runs with (an engine with enable_lora)."""
        if request_id in self.processor.parents or request_id in self.embeddings:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("embedding requests run the base model: LoRA adapters "
                                 "apply to generation")
            self._add_embedding(request_id, prompt, params, arrival_time)
            return
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got "
                                 f"{type(lora_request).__name__}")
            self.add_lora(lora_request)
        if self.task != "generate":
            raise ValueError(f"this engine computes embeddings (task {self.task!r}) and does "
                             "not generate text")
        params.validate(vocab_size=self.vocab_size)
        text, token_ids = self.encode_prompt(prompt)
        if grammar is None:
            grammar = self.compile_grammar(params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = self._child_requests(request_id, token_ids, params, arrival)
        for child in children:  # n > 1: each sample walks the grammar on its own
            child.grammar = grammar
            child.lora_request = lora_request
        added: list[str] = []
        try:
            for child in children:
                self.core.add_request(child)
                added.append(child.request_id)
        except BaseException:
            self.core.abort_requests(added)
            raise
        beam = children[0].beam
        output_ids = list(beam.output_ids) if beam is not None else [c.request_id
                                                                    for c in children]
        self.processor.add_request(request_id, output_ids, text,
                                   token_ids, params, kind, arrival)

    def _add_embedding(self, request_id: str, prompt: PromptType, params: PoolingParams,
                       arrival_time: float | None) -> None:
        if self.task != "embed":
            raise ValueError(f"this engine generates text (task {self.task!r}); embeddings need "
                             "an engine started with task 'embed'")
        params.validate(hidden_size=self.embedding_size)
        text, token_ids = embedding_prompt(self.encode_prompt, self.tokenizer, prompt, params,
                                           self.max_model_len)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.core.add_request(Request(request_id, token_ids, EMBEDDING_SAMPLING,
                                      arrival_time=arrival, pooling_params=params))
        self.embeddings.add(request_id, text, token_ids, arrival)

    def _child_requests(self, request_id: str, token_ids: list[int], params: SamplingParams,
                        arrival: float) -> list[Request]:
        eos = self.tokenizer.eos_token_ids
        if params.use_beam_search:
            return [beam_search_request(request_id, token_ids, params, eos, self.vocab_size,
                                        arrival)]
        if params.n == 1:
            return [Request(request_id, token_ids, params, eos, arrival_time=arrival)]
        children = []
        for i in range(params.n):
            # Each sample gets its own seed stream, derived from the request's seed (wrapping
            # inside the seed's 63-bit range).
            seed = None if params.seed is None else (params.seed + i) % (MAX_SEED + 1)
            child_params = dataclasses.replace(params, n=1, seed=seed)
            # Samples after the first share its prompt's KV blocks instead of recomputing them.
            children.append(Request(f"{request_id}#{i}", token_ids, child_params, eos,
                                    arrival_time=arrival,
                                    fork_of=f"{request_id}#0" if i else None))
        return children

    def abort_request(self, request_id: str) -> RequestOutput | EmbeddingRequestOutput | None:
        """Stop a request wherever it is; returns its final output (finish_reason "abort")."""
        if request_id in self.embeddings:
            self.core.abort_requests([request_id])
            return self.embeddings.abort(request_id)
        self.core.abort_requests(self.processor.child_ids(request_id))
        return self.processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One engine step; returns the outputs of requests that have news."""
        embedded, core_outputs = self.embeddings.split(self.core.step())
        outputs, stopped = self.processor.process(core_outputs)
        if stopped:
            self.core.finish_stopped(stopped)
        return [*outputs, *embedded]
