"""What chat and completions answers share: outputs collected into a whole response, usage,
logprobs JSON can carry, and the shape of a prepared request that the front doors answer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from pydantic import BaseModel

from tokenmill.api.errors import APIError
from tokenmill.api.protocol import PromptTokensDetails, UsageInfo
from tokenmill.engine.async_llm import EngineDeadError, RequestGroup
from tokenmill.engine.llm_engine import PromptType
from tokenmill.outputs import ComputeUsage, RequestOutput, TokenLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer

# A logprob JSON can carry (JSON has no -inf).
MIN_LOGPROB = -9999.0


def usage_info(prompt_tokens: int, completion_tokens: int,
               compute: ComputeUsage | None = None,
               cached_tokens: int | None = None) -> UsageInfo:
    """OpenAI's ``usage`` object, with the prompt tokens served from the prefix cache and the
    compute, energy and cost when known."""
    info = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)
    if cached_tokens is not None:
        info.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached_tokens)
    if compute is not None:
        info.compute_seconds = round(compute.compute_seconds, 6)
        info.energy_joules = round(compute.energy_joules, 6)
        info.energy_estimated = compute.energy_estimated
        info.cost_usd = round(compute.cost_usd, 9)
    return info


def total_cached(per_prompt: Sequence[int | None]) -> int | None:
    """The prompts' cached tokens together; None when no prompt was scheduled."""
    known = [n for n in per_prompt if n is not None]
    return sum(known) if known else None


@dataclass
class Choice:
    """One output sequence, accumulated from DELTA outputs."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Its token ids (a reasoning model's thinking tokens are counted from them).
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Collected:
    """Everything a non-streaming response needs, per prompt."""

    choices: list[list[Choice]]  # [prompt][sequence]
    prompt_token_ids: list[list[int]]
    prompt_logprobs: list[list[TokenLogprobs | None] | None]
    # Each prompt's compute, energy and cost (its latest output's).
    compute: list[ComputeUsage] = field(default_factory=list)
    # Each prompt's tokens served from the prefix cache (None: not scheduled yet).
    cached: list[int | None] = field(default_factory=list)

    @classmethod
    def from_final(cls, outputs: Sequence[RequestOutput]) -> Collected:
        """The same, from each prompt's final (FINAL_ONLY or CUMULATIVE) output, in order."""
        return cls(
            [[Choice([c.text], len(c.token_ids), list(c.logprobs or []), c.finish_reason,
                     c.stop_reason, list(c.token_ids)) for c in out.outputs]
             for out in outputs],
            [out.prompt_token_ids for out in outputs], [out.prompt_logprobs for out in outputs],
            [out.metrics.usage for out in outputs],
            [out.metrics.num_cached_tokens for out in outputs])

    def usage(self) -> UsageInfo:
        prompt = sum(len(p) for p in self.prompt_token_ids)
        completion = sum(c.num_tokens for per_prompt in self.choices for c in per_prompt)
        return usage_info(prompt, completion, ComputeUsage.total(self.compute),
                          total_cached(self.cached))


async def collect(group: RequestGroup, num_prompts: int, n: int) -> Collected:
    """Run the group to the end; ``group`` is closed whatever happens."""
    out = Collected([[Choice() for _ in range(n)] for _ in range(num_prompts)],
                    [[] for _ in range(num_prompts)], [None] * num_prompts,
                    [ComputeUsage() for _ in range(num_prompts)], [None] * num_prompts)
    try:
        async for index, result in group:
            out.prompt_token_ids[index] = result.prompt_token_ids
            out.prompt_logprobs[index] = result.prompt_logprobs
            out.compute[index] = result.metrics.usage.copy()
            out.cached[index] = result.metrics.num_cached_tokens
            for c in result.outputs:
                choice = out.choices[index][c.index]
                choice.text.append(c.text)
                choice.num_tokens += len(c.token_ids)
                choice.token_ids.extend(c.token_ids)
                choice.logprobs.extend(c.logprobs or [])
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    except EngineDeadError as e:
        raise engine_error(e) from None
    finally:
        group.close()
    return out


def engine_error(e: EngineDeadError) -> APIError:
    """The 500 of a request whose engine died under it."""
    return APIError(500, str(e), code="engine_error")


@dataclass
class StreamUsage:
    """Tokens of a streamed response, counted from its DELTA outputs."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> its tokens
    completion_tokens: int = 0
    compute: dict[int, ComputeUsage] = field(default_factory=dict)  # prompt index -> latest
    cached: dict[int, int | None] = field(default_factory=dict)  # prompt index -> cached tokens

    def add(self, index: int, out: RequestOutput) -> None:
        self.prompt_tokens[index] = len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.compute[index] = out.metrics.usage.copy()
        self.cached[index] = out.metrics.num_cached_tokens

    def info(self) -> UsageInfo:
        return usage_info(sum(self.prompt_tokens.values()), self.completion_tokens,
                          ComputeUsage.total(list(self.compute.values())),
                          total_cached(list(self.cached.values())))


class StreamChunks(Protocol):
    """The chunks of one streamed response, built from the engine's DELTA outputs."""

    def opening(self) -> list[BaseModel]:
        """Chunks sent before any output (the chat role)."""
        ...

    def delta(self, index: int, out: RequestOutput) -> BaseModel | None:
        """The chunk of one output of prompt ``index``; None when it has nothing to send."""
        ...

    def usage(self, usage: UsageInfo) -> BaseModel:
        """The last chunk, with no choices and the usage, when the client asked for it."""
        ...


class Call(Protocol):
    """A validated request: what to submit to the engine and how to answer it, whole or
    streamed. Built by ``prepare_chat`` / ``prepare_completion``."""

    id_prefix: ClassVar[str]  # of the response id, e.g. "chatcmpl"

    @property
    def engine_prompts(self) -> list[PromptType]:
        """One engine request each, in the order of the request's prompts."""
        ...

    @property
    def params(self) -> SamplingParams: ...

    def response(self, result: Collected, model: str, rid: str, created: int) -> BaseModel:
        """The whole body of the finished request."""
        ...

    def chunks(self, model: str, rid: str, created: int) -> StreamChunks:
        """The builder of its streamed chunks."""
        ...


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
