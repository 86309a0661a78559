"""POST /v1/chat/completions and /v1/completions: validate (in api/), submit to the engine,
answer whole or as server-sent events."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from tokenmill.api.chat import ChatCall
from tokenmill.api.completions import CompletionCall
from tokenmill.api.endpoints import prepare
from tokenmill.api.errors import APIError
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest, now, random_id
from tokenmill.api.reasoning import ReasoningSetup
from tokenmill.api.response_building import Collected, collect
from tokenmill.api.validation import engine_refusal
from tokenmill.engine.async_llm import (
    EngineDeadError,
    EngineOverloadedError,
    RequestGroup,
)
from tokenmill.engine.llm_engine import PromptType
from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.server.state import ServedModel, ServerState
from tokenmill.server.streaming import EngineStreamingResponse, stream_events, until_disconnect
from tokenmill.tenancy.meter import meter, with_priority

# Seconds a client is told to wait after a 503 for a full queue.
RETRY_AFTER_S = 1


async def submit(state: ServerState, served: ServedModel, prompts: Sequence[PromptType],
                 params: SamplingParams | PoolingParams, prefix: str) -> RequestGroup:
    """Queue the prompts in ``served``'s engine (with its LoRA adapter, if it is one),
    turning refusals into HTTP errors."""
    if state.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    try:
        # A project's request runs at its project's priority and is metered for it.
        return meter(await served.client.submit(prompts, with_priority(params), prefix,
                                                lora_request=served.lora), served.name,
                     served.path)
    except EngineOverloadedError as e:
        raise APIError(503, f"the server is overloaded ({e}); retry later", code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from None
    except ValueError as e:
        raise engine_refusal(e) from None


async def collect_unless_gone(group: RequestGroup, num_prompts: int, n: int,
                              receive: Receive) -> Collected | None:
    """The group's whole answer, or None if the client disconnects first (its requests are
    then aborted)."""
    try:
        return await until_disconnect(receive, collect(group, num_prompts, n))
    finally:
        # ``collect`` closes the group itself, but not if it is cancelled before its first
        # step (this handler cancelled at once, e.g. at shutdown): the group must not leak.
        group.close()


def reasoning_setup(state: ServerState) -> ReasoningSetup:
    """The server's reasoning parser and default thinking budget."""
    return ReasoningSetup(state.config.reasoning_parser, state.config.max_thinking_tokens)


async def start_generation(state: ServerState, served: ServedModel,
                           req: ChatCompletionRequest | CompletionRequest,
                           ) -> tuple[ChatCall | CompletionCall, RequestGroup]:
    """Validate a chat or completions request (off the event loop) and queue it in
    ``served``'s engine, holding the model while it is prepared."""
    with served.lease():
        call = await state.offload(functools.partial(
            prepare, split_special_tokens=state.config.split_special_tokens,
            tool_call_parser=state.config.tool_call_parser,
            reasoning=reasoning_setup(state)), req, served.client)
        group = await submit(state, served, call.engine_prompts, call.params, call.id_prefix)
    return call, group


async def create_response(state: ServerState, req: ChatCompletionRequest | CompletionRequest,
                          raw: Request) -> Response:
    """Validate, submit and answer one chat or completions request."""
    served = await state.resolve(req.model)
    model = served.name
    call, group = await start_generation(state, served, req)
    rid, created = random_id(call.id_prefix), now()
    if req.stream:
        events = stream_events(group, call.chunks(model, rid, created), req.include_usage)
        return EngineStreamingResponse(events, group.close)
    result = await collect_unless_gone(group, len(call.engine_prompts), call.params.n,
                                       raw.receive)
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    return JSONResponse(call.response(result, model, rid, created).model_dump())
