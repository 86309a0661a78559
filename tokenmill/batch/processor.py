"""Runs batch requests through one engine, many at once, and answers each as it finishes.

Up to ``max_in_flight`` requests sit in the engine together, so continuous batching keeps it
full; a finished request's slot is refilled before the next step. Bodies are validated and
answered by the API's code (``prepare`` and the call's ``response``, tokenmill/api/), so a batch
line gets the status and body that the HTTP endpoint would have returned.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.api.batch_format import BatchRequest, api_error_line, response_line
from tokenmill.api.classify import ClassifyCall, ClassifyRequest, prepare_classify
from tokenmill.api.embeddings import EmbeddingRequest, PoolingCall, prepare_embeddings
from tokenmill.api.endpoints import ENDPOINTS, prepare
from tokenmill.api.errors import APIError, bad_request, validate_body
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest, now, random_id
from tokenmill.api.response_building import Call, Collected
from tokenmill.api.scores import RerankRequest, ScoreRequest, prepare_rerank, prepare_score
from tokenmill.api.validation import default_model_name, engine_refusal
from tokenmill.batch import DEFAULT_MAX_IN_FLIGHT
from tokenmill.engine.classify import LabelRequest
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class Answer:
    """An output line and what it cost, for the progress bar and the summary."""

    line: int
    text: str
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0


class _Job(Protocol):
    """One input line's work in the engine."""

    request: BatchRequest

    @property
    def weight(self) -> int:
        """Engine requests it holds at once, counted against the in-flight limit."""
        ...

    @property
    def complete(self) -> bool: ...

    def start(self, engine: LLMEngine) -> list[str]:
        """Queue its first engine requests; their ids. ValueError from the engine."""
        ...

    def finish(self, out: RequestOutput, engine: LLMEngine) -> list[str]:
        """Take one of its requests' final output; the ids of requests it queued next."""
        ...

    def live_ids(self) -> list[str]:
        """Its engine requests queued (or perhaps queued) and not finished."""
        ...

    def answer(self, model_name: str) -> Answer: ...


@dataclass
class _GenerateJob:
    """Chat or completions: one engine request per prompt, answered when all have finished;
    ``lora``: the adapter its body's ``model`` names (None: the base model)."""

    request: BatchRequest
    call: Call
    lora: LoRARequest | None = None
    outputs: dict[str, RequestOutput] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.call.engine_prompts)
        self.request_ids = [f"b{self.request.line}-{i}" for i in range(n)]

    @property
    def weight(self) -> int:
        return 1

    @property
    def complete(self) -> bool:
        return len(self.outputs) == len(self.request_ids)

    def start(self, engine: LLMEngine) -> list[str]:
        for rid, prompt in zip(self.request_ids, self.call.engine_prompts, strict=True):
            engine.add_request(rid, prompt, self.call.params, lora_request=self.lora)
        return self.request_ids

    def finish(self, out: RequestOutput, engine: LLMEngine) -> list[str]:
        self.outputs[out.request_id] = out
        return []

    def live_ids(self) -> list[str]:
        return [rid for rid in self.request_ids if rid not in self.outputs]

    def answer(self, model_name: str) -> Answer:
        result = Collected.from_final([self.outputs[rid] for rid in self.request_ids])
        rid = random_id(self.call.id_prefix)
        name = model_name if self.lora is None else self.lora.lora_name
        body = self.call.response(result, name, rid, now())
        usage = result.usage()
        return Answer(self.request.line, response_line(self.request, body, rid), ok=True,
                      prompt_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)


@dataclass
class _ClassifyJob:
    """/v1/classify: each input's first label, then its other labels once that one has
    computed the prompt (they find it in the prefix cache)."""

    request: BatchRequest
    call: ClassifyCall
    in_flight: dict[str, LabelRequest] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    @property
    def weight(self) -> int:
        # Its labels wait behind fewer first labels of other lines: their prompt is still
        # cached when they run.
        return len(self.call.scorer.labels)

    @property
    def complete(self) -> bool:
        return self.call.scorer.done

    def _add(self, engine: LLMEngine, requests: list[LabelRequest]) -> list[str]:
        added = []
        for request in requests:
            rid = f"b{self.request.line}-{next(self._ids)}"
            engine.add_request(rid, request.prompt, request.params)
            self.in_flight[rid] = request
            added.append(rid)
        return added

    def start(self, engine: LLMEngine) -> list[str]:
        return self._add(engine, self.call.scorer.first_requests())

    def finish(self, out: RequestOutput, engine: LLMEngine) -> list[str]:
        request = self.in_flight.pop(out.request_id)
        return self._add(engine, self.call.scorer.record(request, out.prompt_logprobs))

    def live_ids(self) -> list[str]:
        return list(self.in_flight)

    def answer(self, model_name: str) -> Answer:
        rid = random_id(self.call.id_prefix)
        body = self.call.response(self.call.scorer.results(), model_name, rid, now())
        return Answer(self.request.line, response_line(self.request, body, rid), ok=True,
                      prompt_tokens=body.usage.prompt_tokens)


@dataclass
class _EmbedJob:
    """/v1/embeddings, /v1/score and /v1/rerank: one embedding request per (distinct) input,
    answered when all are computed."""

    request: BatchRequest
    call: PoolingCall
    outputs: dict[str, EmbeddingRequestOutput] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.request_ids = [f"b{self.request.line}-{i}" for i in range(len(self.call.prompts))]

    @property
    def weight(self) -> int:
        return 1

    @property
    def complete(self) -> bool:
        return len(self.outputs) == len(self.request_ids)

    def start(self, engine: LLMEngine) -> list[str]:
        for rid, prompt in zip(self.request_ids, self.call.prompts, strict=True):
            engine.add_request(rid, prompt, self.call.params)
        return self.request_ids

    def finish(self, out: RequestOutput | EmbeddingRequestOutput, engine: LLMEngine) -> list[str]:
        assert isinstance(out, EmbeddingRequestOutput)
        self.outputs[out.request_id] = out
        return []

    def live_ids(self) -> list[str]:
        return [rid for rid in self.request_ids if rid not in self.outputs]

    def answer(self, model_name: str) -> Answer:
        body = self.call.response([self.outputs[rid] for rid in self.request_ids], model_name)
        return Answer(self.request.line, response_line(self.request, body, None), ok=True,
                      prompt_tokens=body.usage.prompt_tokens)


class BatchProcessor:
    """Answers BatchRequests with one engine; ``model_name`` goes into the response bodies
    (None: the model file's name). ``adapters``: LoRA adapters by name; a chat or completions
    line whose ``model`` names one runs with it and is answered under its name."""

    def __init__(self, engine: LLMEngine, model_name: str | None,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 adapters: Mapping[str, LoRARequest] | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.engine = engine
        self.model_name = model_name or default_model_name(engine.model_path)
        self.max_in_flight = max_in_flight
        self.adapters = dict(adapters or {})

    def run(self, requests: Iterable[BatchRequest]) -> Iterator[Answer]:
        """Yield an Answer per request, in the order they finish; ``requests`` is read lazily,
        no further ahead than the in-flight limit."""
        engine = self.engine
        jobs: dict[str, _Job] = {}  # engine request id -> its job
        in_flight = 0
        pending = iter(requests)
        exhausted = False
        try:
            while True:
                while not exhausted and in_flight < self.max_in_flight:
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                        break
                    job = self._submit(req)
                    if isinstance(job, Answer):  # refused: answered at once
                        yield job
                        continue
                    in_flight += job.weight
                    jobs.update(dict.fromkeys(job.live_ids(), job))
                if not engine.has_unfinished_requests():
                    if exhausted:
                        return
                    continue
                for out in engine.step():
                    job = jobs.pop(out.request_id, None) if out.finished else None
                    if job is None:
                        continue
                    answer = self._advance(job, out, jobs)
                    if answer is not None:
                        in_flight -= job.weight
                        yield answer
        finally:  # the caller stopped early (or failed): free what is still in the engine
            for rid in jobs:
                engine.abort_request(rid)

    def _submit(self, req: BatchRequest) -> _Job | Answer:
        """Validate and queue one request; a refusal comes back as its Answer instead."""
        try:
            body = validate_body(req.body, ENDPOINTS[req.url])
            lora = self.adapters.get(getattr(body, "model", None) or "")
            job: _Job
            if lora is not None and not isinstance(body, ChatCompletionRequest
                                                   | CompletionRequest):
                raise bad_request(f"the model {lora.lora_name!r} is a LoRA adapter: adapters "
                                  f"apply to chat and completions, not {req.url}", "model")
            if isinstance(body, ClassifyRequest):
                job = _ClassifyJob(req, prepare_classify(body, self.engine))
            elif isinstance(body, EmbeddingRequest):
                job = _EmbedJob(req, prepare_embeddings(body, self.engine))
            elif isinstance(body, ScoreRequest):
                job = _EmbedJob(req, prepare_score(body, self.engine))
            elif isinstance(body, RerankRequest):
                job = _EmbedJob(req, prepare_rerank(body, self.engine))
            else:
                job = _GenerateJob(req, prepare(body, self.engine), lora)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - answered as its line's error
            return _refusal(req, e)
        try:
            job.start(self.engine)
        except Exception as e:  # noqa: BLE001 - e.g. a prompt the KV cache can never hold
            self._drop(job, {})
            return _refusal(req, e)
        return job

    def _advance(self, job: _Job, out: RequestOutput, jobs: dict[str, _Job]) -> Answer | None:
        """Give a job one of its final outputs; its Answer once it is complete (or failed)."""
        try:
            jobs.update(dict.fromkeys(job.finish(out, self.engine), job))
            return job.answer(self.model_name) if job.complete else None
        except Exception as e:  # noqa: BLE001 - one odd request must not end a long job
            self._drop(job, jobs)
            return _refusal(job.request, e)

    def _drop(self, job: _Job, jobs: dict[str, _Job]) -> None:
        """Abort what a failed job still has in the engine."""
        for rid in job.live_ids():
            jobs.pop(rid, None)
            self.engine.abort_request(rid)


def _refusal(req: BatchRequest, e: Exception) -> Answer:
    """The Answer of a request that failed: its API error, a 400 for the engine's
    ValueError, else a 500 (logged)."""
    if not isinstance(e, APIError):
        if isinstance(e, ValueError):
            e = engine_refusal(e)
        else:
            logger.exception("batch line %d: unexpected error", req.line, exc_info=e)
            e = APIError(500, f"internal error: {type(e).__name__}: {e}")
    return Answer(req.line, api_error_line(req, e), ok=False)
