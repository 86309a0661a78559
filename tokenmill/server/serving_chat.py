"""POST /v1/chat/completions: render the chat template, generate, answer whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_llm import EngineDeadError, RequestGroup
from tokenmill.engine.llm_engine import PromptType
from tokenmill.outputs import TokenLogprobs
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
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


def render_prompt(tokenizer: Tokenizer, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The chat template applied to the messages, and its token ids; 400 if it cannot be."""
    try:
        text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                             **(req.chat_template_kwargs or {}))
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise bad_request(f"messages: {e}", "messages") from None
    # The template already holds any BOS the model wants.
    return text, tokenizer.encode(text, add_special_tokens=False)


def chat_logprobs(lps: list[TokenLogprobs], k: int, texts: TokenTexts) -> ChatLogprobs:
    """OpenAI's chat ``logprobs.content`` for the given tokens, with ``k`` alternatives each."""
    content = []
    for lp in lps:
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:k]
        token = texts(lp.token_id)
        content.append(ChatTokenLogprob(
            token=token, logprob=finite(lp.logprob), bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=texts(t), logprob=finite(v),
                                     bytes=list(texts(t).encode())) for t, v in top]))
    return ChatLogprobs(content=content)


def logprobs_k(req: ChatCompletionRequest) -> int | None:
    """Alternatives per token that the response's logprobs carry; None without logprobs."""
    return (req.top_logprobs or 0) if req.logprobs else None


def prepare_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, vocab_size: int,
                 max_model_len: int) -> tuple[PromptType, SamplingParams]:
    """The engine prompt and sampling parameters of a chat request; 400 names the bad field.

    Shared by the server and the batch job, so both accept and reject the same bodies."""
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                          "top_logprobs")
    text, ids = render_prompt(tokenizer, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be >= 1, got {max_tokens}", param)
    check_context(len(ids), max_tokens, max_model_len, "messages", param)
    params = sampling_params(req, vocab_size, max_tokens=max_tokens, logprobs=logprobs_k(req))
    return {"prompt": text, "prompt_token_ids": ids}, params


def chat_response(req: ChatCompletionRequest, result: Collected, tokenizer: Tokenizer,
                  model: str, rid: str, created: int) -> ChatCompletionResponse:
    """The whole (non-streamed) response body of a finished chat request."""
    texts = TokenTexts(tokenizer)
    k = logprobs_k(req)
    choices = [
        ChatChoice(index=i, message=ChatMessage(content="".join(c.text)),
                   logprobs=chat_logprobs(c.logprobs, k, texts) if k is not None else None,
                   finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for i, c in enumerate(result.choices[0])]
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=result.usage())


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                 raw: Request) -> Response:
    """Validate, submit and answer one chat completion request."""
    model = check_model(state, req.model)
    client = state.client
    prompt, params = prepare_chat(req, client.tokenizer, client.vocab_size, client.max_model_len)
    group = await submit(state, [prompt], params, "chatcmpl")
    rid, created = random_id("chatcmpl"), now()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream(state, group, req, model, rid, created, include_usage)
        return EngineStreamingResponse(events, group.close)
    result = await until_disconnect(raw.receive, collect(group, 1, req.n))
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    body = chat_response(req, result, client.tokenizer, model, rid, created)
    return JSONResponse(body.model_dump())


async def _stream(state: ServerState, group: RequestGroup, req: ChatCompletionRequest,
                  model: str, rid: str, created: int, include_usage: bool) -> AsyncIterator[str]:
    """Chunks: the role first, then content deltas, the finish reasons, usage, [DONE]."""
    texts = TokenTexts(state.client.tokenizer)
    k = logprobs_k(req)

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices,
                                       usage=usage).model_dump_json())

    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(req.n)])
    prompt_tokens = completion_tokens = 0
    done: set[int] = set()  # a finished sequence keeps its finish_reason in later deltas
    try:
        async for _, out in group:
            prompt_tokens = len(out.prompt_token_ids)
            choices = []
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                if c.index in done or (not c.text and not c.token_ids and not c.finished):
                    continue
                if c.finished:
                    done.add(c.index)
                lps = chat_logprobs(c.logprobs or [], k, texts) if k is not None else None
                choices.append(ChatChunkChoice(
                    index=c.index, delta=DeltaMessage(content=c.text), logprobs=lps,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            if choices:
                yield chunk(choices)
    except EngineDeadError as e:
        yield error_event(APIError(500, str(e), code="engine_error"))
        yield sse("[DONE]")
        return
    if include_usage:
        yield chunk([], UsageInfo(prompt_tokens=prompt_tokens,
                                  completion_tokens=completion_tokens,
                                  total_tokens=prompt_tokens + completion_tokens))
    yield sse("[DONE]")
