"""POST /v1/completions: one or more prompts (text or token ids), answered whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_llm import EngineDeadError, RequestGroup
from tokenmill.engine.llm_engine import PromptType
from tokenmill.outputs import CompletionOutput, TokenLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    now,
    random_id,
)
from tokenmill.server.serving_base import (
    Collected,
    EngineStreamingResponse,
    TokenTexts,
    check_context,
    check_model,
    check_token_ids,
    collect,
    error_event,
    finite,
    sampling_params,
    sse,
    submit,
    until_disconnect,
)
from tokenmill.server.state import ServerState
from tokenmill.tokenizer import Tokenizer


@dataclass
class CompletionPrompt:
    """One prompt of a completions request, as the engine and the response need it."""

    engine_prompt: PromptType
    token_ids: list[int]
    text: str  # for echo


def _prompts(req: CompletionRequest, tok: Tokenizer, vocab: int) -> list[CompletionPrompt]:
    """Tokenized, validated prompts; 400 names what is wrong."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # type: ignore[list-item]
    if not raw:
        raise bad_request("prompt must not be empty", "prompt")
    out = []
    for p in raw:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be an empty string", "prompt")
            ids = tok.encode(p)
            out.append(CompletionPrompt({"prompt": p, "prompt_token_ids": ids}, ids, p))
        else:
            check_token_ids(p, vocab, "prompt")
            text = tok.decode(p, skip_special_tokens=False)
            out.append(CompletionPrompt(list(p), list(p), text))
    return out


def completion_logprobs(token_ids: list[int], lps: list[TokenLogprobs | None], k: int,
                        texts: TokenTexts, offset: int) -> CompletionLogprobs:
    """The legacy completions ``logprobs`` object; a None entry (first prompt token) has none."""
    out = CompletionLogprobs()
    for tid, lp in zip(token_ids, lps, strict=True):
        token = texts(tid)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(finite(lp.logprob))
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:k]
        out.top_logprobs.append({texts(t): finite(v) for t, v in top})
    return out


def _merge(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def _echo_logprobs(prompt: CompletionPrompt, lps: list[TokenLogprobs | None] | None, k: int,
                   texts: TokenTexts) -> CompletionLogprobs:
    entries = list(lps or [None])
    entries += [None] * (len(prompt.token_ids) - len(entries))
    return completion_logprobs(prompt.token_ids, entries[:len(prompt.token_ids)], k, texts, 0)


def prepare_completion(req: CompletionRequest, tokenizer: Tokenizer, vocab_size: int,
                       max_model_len: int) -> tuple[list[CompletionPrompt], SamplingParams]:
    """The prompts and sampling parameters of a completions request; 400 names the bad field.

    Shared by the server and the batch job, so both accept and reject the same bodies."""
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    best_of = req.n if req.best_of is None else req.best_of
    if best_of < req.n:
        raise bad_request(f"best_of must be >= n ({req.n}), got {best_of}", "best_of")
    if best_of > req.n and req.stream:
        raise bad_request("best_of > n cannot be streamed: the best are known only at the end",
                          "best_of")
    prompts = _prompts(req, tokenizer, vocab_size)
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
    for p in prompts:
        check_context(len(p.token_ids), req.max_tokens, max_model_len, "prompt")
    # best_of ranks its samples by the sum of their tokens' logprobs: ask for those.
    k = req.logprobs
    params = sampling_params(req, vocab_size, max_tokens=req.max_tokens,
                             logprobs=0 if k is None and best_of > req.n else k,
                             prompt_logprobs=k if req.echo else None)
    return prompts, replace(params, n=best_of)


def completion_response(req: CompletionRequest, prompts: list[CompletionPrompt],
                        result: Collected, tokenizer: Tokenizer, model: str, rid: str,
                        created: int) -> CompletionResponse:
    """The whole (non-streamed) response body of a finished completions request."""
    texts = TokenTexts(tokenizer)
    k = req.logprobs
    choices = []
    for p_index, (prompt, per_prompt) in enumerate(zip(prompts, result.choices, strict=True)):
        if len(per_prompt) > req.n:  # best_of: the most likely samples
            per_prompt = sorted(per_prompt, key=lambda c: -sum(lp.logprob for lp in c.logprobs))
        for c_index, c in enumerate(per_prompt[:req.n]):
            text = "".join(c.text)
            lps = None
            if k is not None:
                ids = [lp.token_id for lp in c.logprobs]
                offset = len(prompt.text) if req.echo else 0
                lps = completion_logprobs(ids, list(c.logprobs), k, texts, offset)
                if req.echo:
                    lps = _merge(_echo_logprobs(prompt, result.prompt_logprobs[p_index], k,
                                                texts), lps)
            choices.append(CompletionChoice(
                index=p_index * req.n + c_index, text=prompt.text + text if req.echo else text,
                logprobs=lps, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                              usage=result.usage())


async def create_completion(state: ServerState, req: CompletionRequest,
                            raw: Request) -> Response:
    """Validate, submit and answer one completions request."""
    model = check_model(state, req.model)
    client = state.client
    prompts, params = prepare_completion(req, client.tokenizer, client.vocab_size,
                                         client.max_model_len)
    group = await submit(state, [p.engine_prompt for p in prompts], params, "cmpl")
    rid, created = random_id("cmpl"), now()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream(state, group, req, prompts, model, rid, created, include_usage)
        return EngineStreamingResponse(events, group.close)
    result = await until_disconnect(raw.receive, collect(group, len(prompts), params.n))
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    body = completion_response(req, prompts, result, client.tokenizer, model, rid, created)
    return JSONResponse(body.model_dump())


def _stream_choice(req: CompletionRequest, prompt: CompletionPrompt,
                   prompt_lps: list[TokenLogprobs | None] | None, c: CompletionOutput,
                   index: int, first: bool, offset: int, texts: TokenTexts) -> CompletionChoice:
    """One choice's delta; the first one of a choice carries the prompt when echoing."""
    echo = req.echo and first
    lps = None
    if req.logprobs is not None:
        own = list(c.logprobs or [])
        base = offset + (len(prompt.text) if echo else 0)
        lps = completion_logprobs([lp.token_id for lp in own], own, req.logprobs, texts, base)
        if echo:
            lps = _merge(_echo_logprobs(prompt, prompt_lps, req.logprobs, texts), lps)
    return CompletionChoice(index=index, text=prompt.text + c.text if echo else c.text,
                            logprobs=lps, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason)


async def _stream(state: ServerState, group: RequestGroup, req: CompletionRequest,
                  prompts: list[CompletionPrompt], model: str, rid: str, created: int,
                  include_usage: bool) -> AsyncIterator[str]:
    """Chunks of new text per choice (echo first), usage when asked, then [DONE]."""
    texts = TokenTexts(state.client.tokenizer)
    started: set[int] = set()  # choices that sent text (and their echo)
    done: set[int] = set()  # a finished sequence keeps its finish_reason in later deltas
    offsets: dict[int, int] = {}
    completion_tokens = 0
    try:
        async for p_index, out in group:
            prompt, choices = prompts[p_index], []
            for c in out.outputs:
                index = p_index * req.n + c.index
                completion_tokens += len(c.token_ids)
                if index in done or (not c.token_ids and not c.finished):
                    continue
                choice = _stream_choice(req, prompt, out.prompt_logprobs, c, index,
                                        index not in started, offsets.get(index, 0), texts)
                started.add(index)
                offsets[index] = offsets.get(index, 0) + len(choice.text)
                if c.finished:
                    done.add(index)
                choices.append(choice)
            if choices:
                yield sse(CompletionResponse(id=rid, created=created, model=model,
                                             choices=choices).model_dump_json())
    except EngineDeadError as e:
        yield error_event(APIError(500, str(e), code="engine_error"))
        yield sse("[DONE]")
        return
    if include_usage:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                     usage=UsageInfo(prompt_tokens=prompt_tokens,
                                                     completion_tokens=completion_tokens,
                                                     total_tokens=prompt_tokens
                                                     + completion_tokens)).model_dump_json())
    yield sse("[DONE]")
