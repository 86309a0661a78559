"""What chat and completions share: sampling parameters, limits, submission, collection of
outputs, server-sent events, and aborting a request when its client goes away."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.engine.async_llm import EngineDeadError, EngineOverloadedError, RequestGroup
from tokenmill.engine.llm_engine import PromptType
from tokenmill.outputs import RequestOutput, TokenLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import UsageInfo, _SamplingFields
from tokenmill.server.state import ServerState
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds a client is told to wait after a 503 for a full queue.
RETRY_AFTER_S = 1
# A logprob JSON can carry (JSON has no -inf).
MIN_LOGPROB = -9999.0


def check_model(state: ServerState, model: str | None) -> str:
    """The served model's name; 404 if the request names another model."""
    served = state.model_name
    if model is not None and model != served:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")
    return served


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out = {}
    for key, bias in raw.items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None
    return out


def sampling_params(req: _SamplingFields, vocab_size: int, *, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams, validated against the vocabulary; 400 names the field."""
    try:
        params = SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias), stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens, speculative=req.speculative)
        params.validate(vocab_size=vocab_size)
    except ValueError as e:
        raise bad_request(str(e), _param_of(str(e))) from None
    return params


def _param_of(message: str) -> str | None:
    """The field a SamplingParams error names (its messages start with the field)."""
    head = message.split(" ", 1)[0].split("[", 1)[0]
    return head if head.isidentifier() else None


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  param: str, max_tokens_param: str = "max_tokens") -> None:
    """400 when the prompt, plus the tokens asked for, does not fit the context."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, and the prompt "
            f"has {prompt_len}: it must leave room for at least one generated token", param)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)",
            max_tokens_param)


def check_token_ids(ids: Sequence[Any], vocab_size: int, param: str) -> None:
    """400 unless every id is an integer in [0, vocab_size)."""
    if not ids:
        raise bad_request(f"{param} must not be empty", param)
    for i, tid in enumerate(ids):
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
            raise bad_request(
                f"{param}: token id at index {i} must be in [0, {vocab_size}), got {tid!r}", param)


async def submit(state: ServerState, prompts: Sequence[PromptType], params: SamplingParams,
                 prefix: str) -> RequestGroup:
    """Queue the prompts in the engine, turning refusals into HTTP errors."""
    if state.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    try:
        return await state.client.submit(prompts, params, prefix)
    except EngineOverloadedError as e:
        raise APIError(503, f"the server is overloaded ({e}); retry later", code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from None
    except ValueError as e:
        raise bad_request(str(e)) from None


@dataclass
class Choice:
    """One output sequence, accumulated from DELTA outputs."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Collected:
    """Everything a non-streaming response needs, per prompt."""

    choices: list[list[Choice]]  # [prompt][sequence]
    prompt_token_ids: list[list[int]]
    prompt_logprobs: list[list[TokenLogprobs | None] | None]

    @classmethod
    def from_final(cls, outputs: Sequence[RequestOutput]) -> Collected:
        """The same, from each prompt's final (FINAL_ONLY or CUMULATIVE) output, in order."""
        return cls(
            [[Choice([c.text], len(c.token_ids), list(c.logprobs or []), c.finish_reason,
                     c.stop_reason) for c in out.outputs] for out in outputs],
            [out.prompt_token_ids for out in outputs], [out.prompt_logprobs for out in outputs])

    def usage(self) -> UsageInfo:
        prompt = sum(len(p) for p in self.prompt_token_ids)
        completion = sum(c.num_tokens for per_prompt in self.choices for c in per_prompt)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)


async def collect(group: RequestGroup, num_prompts: int, n: int) -> Collected:
    """Run the group to the end; ``group`` is closed whatever happens."""
    out = Collected([[Choice() for _ in range(n)] for _ in range(num_prompts)],
                    [[] for _ in range(num_prompts)], [None] * num_prompts)
    try:
        async for index, result in group:
            out.prompt_token_ids[index] = result.prompt_token_ids
            out.prompt_logprobs[index] = result.prompt_logprobs
            for c in result.outputs:
                choice = out.choices[index][c.index]
                choice.text.append(c.text)
                choice.num_tokens += len(c.token_ids)
                choice.logprobs.extend(c.logprobs or [])
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    except EngineDeadError as e:
        raise APIError(500, str(e), code="engine_error") from None
    finally:
        group.close()
    return out


class TokenTexts:
    """Text of single token ids (for logprobs), cached per response."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def finite(logprob: float) -> float:
    """A logprob JSON can encode (JSON has no -inf or NaN)."""
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def sse(data: str) -> str:
    """One server-sent event."""
    return f"data: {data}\n\n"


def error_event(err: APIError) -> str:
    """An error in the middle of a stream: the openai client raises it as an APIError."""
    return sse(err.body().model_dump_json())


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone away (after the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T | None:
    """Await ``work``, cancelling it (None) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():  # the client left (or we are cancelled): stop the work too
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


class EngineStreamingResponse(StreamingResponse):
    """A server-sent-event stream of engine outputs that stops at the client's disconnect.

    ``on_close`` runs however the response ends (finished, client gone, error, never started),
    so the engine requests behind it are always aborted or already finished.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self.stream_response(send))
        except OSError:  # the client went away while we were writing
            pass
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
