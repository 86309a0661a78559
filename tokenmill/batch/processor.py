"""Runs batch requests through one engine, many at once, and answers each as it finishes.

Up to ``max_in_flight`` requests sit in the engine together, so continuous batching keeps it
full; a finished request's slot is refilled before the next step. Bodies are validated and
answered by the API's code (``prepare`` and the call's ``response``, tokenmill/api/), so a batch
line gets the status and body that the HTTP endpoint would have returned.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tokenmill.api.endpoints import ENDPOINTS, prepare
from tokenmill.api.errors import APIError, bad_request, validate_body
from tokenmill.api.protocol import now, random_id
from tokenmill.api.responses import Call, Collected
from tokenmill.api.validation import default_model_name
from tokenmill.batch import DEFAULT_MAX_IN_FLIGHT
from tokenmill.batch.format import BatchRequest, api_error_line, response_line
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class Answer:
    """An output line and what it cost, for the progress bar and the summary."""

    line: int
    text: str
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass
class _Job:
    request: BatchRequest
    call: Call
    request_ids: list[str]  # one engine request per prompt
    outputs: dict[str, RequestOutput] = field(default_factory=dict)


class BatchProcessor:
    """Answers BatchRequests with one engine; ``model_name`` goes into the response bodies
    (None: the model file's name)."""

    def __init__(self, engine: LLMEngine, model_name: str | None,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.engine = engine
        self.model_name = model_name or default_model_name(engine.model_path)
        self.max_in_flight = max_in_flight

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
                    in_flight += 1
                    jobs.update(dict.fromkeys(job.request_ids, job))
                if not engine.has_unfinished_requests():
                    if exhausted:
                        return
                    continue
                for out in engine.step():
                    job = jobs.pop(out.request_id, None) if out.finished else None
                    if job is None:
                        continue
                    job.outputs[out.request_id] = out
                    if len(job.outputs) == len(job.request_ids):
                        in_flight -= 1
                        yield self._answer(job)
        finally:  # the caller stopped early (or failed): free what is still in the engine
            for rid in jobs:
                engine.abort_request(rid)

    def _submit(self, req: BatchRequest) -> _Job | Answer:
        """Validate and queue one request; a refusal comes back as its Answer instead."""
        try:
            return self._queue(req)
        except APIError as e:
            return Answer(req.line, api_error_line(req, e), ok=False)
        except Exception as e:  # one odd request must not end a long job
            logger.exception("batch line %d: unexpected error", req.line)
            err = APIError(500, f"internal error: {type(e).__name__}: {e}")
            return Answer(req.line, api_error_line(req, err), ok=False)

    def _queue(self, req: BatchRequest) -> _Job:
        engine = self.engine
        call = prepare(validate_body(req.body, ENDPOINTS[req.url]), engine)
        prompts = call.engine_prompts
        request_ids = [f"b{req.line}-{i}" for i in range(len(prompts))]
        added: list[str] = []
        try:
            for rid, prompt in zip(request_ids, prompts, strict=True):
                engine.add_request(rid, prompt, call.params)
                added.append(rid)
        except ValueError as e:  # e.g. a prompt the KV cache can never hold
            for rid in added:
                engine.abort_request(rid)
            raise bad_request(str(e)) from None
        return _Job(req, call, request_ids)

    def _answer(self, job: _Job) -> Answer:
        result = Collected.from_final([job.outputs[rid] for rid in job.request_ids])
        rid = random_id(job.call.id_prefix)
        body = job.call.response(result, self.model_name, rid, now())
        usage = result.usage()
        return Answer(job.request.line, response_line(job.request, body, rid), ok=True,
                      prompt_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)
