"""Anthropic's Messages API on the same port: POST /v1/messages (whole or streamed with
Anthropic's events) and /v1/messages/count_tokens, for the Anthropic SDK and the agent tools
that speak it. The key is read from ``x-api-key`` (Anthropic's header) or ``Authorization:
Bearer``; errors have Anthropic's body (server/errors.py answers every /v1/messages error so).
Requests become chat completions requests (api/anthropic.py) and run through the same path."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.api.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    error_body,
    renamed,
)
from tokenmill.api.anthropic_messages import (
    MessageEvents,
    count_tokens,
    event,
    message,
    message_id,
)
from tokenmill.api.chat import ChatCall
from tokenmill.api.errors import APIError
from tokenmill.api.protocol import now, random_id
from tokenmill.api.reasoning import resolve_reasoning_parser
from tokenmill.api.response_building import StreamUsage, engine_error
from tokenmill.engine.async_llm import EngineDeadError, RequestGroup
from tokenmill.server.errors import read_json
from tokenmill.server.serving import collect_unless_gone, reasoning_setup, start_generation
from tokenmill.server.state import ServerState
from tokenmill.server.streaming import EngineStreamingResponse
from tokenmill.tenancy.meter import current_tab


def anthropic_router(state: ServerState) -> APIRouter:
    """The /v1/messages routes, behind the API key (``x-api-key`` or a Bearer token)."""

    async def require_key(request: Request) -> None:
        if current_tab.get() is not None:  # a project key, checked by the tenancy guard
            return
        key = request.headers.get("x-api-key")
        authorization = f"Bearer {key}" if key is not None else \
            request.headers.get("authorization")
        if not state.key_matches(authorization):
            raise APIError(401, "missing or invalid API key (send x-api-key: <key>)",
                           code="invalid_api_key")

    router = APIRouter(dependencies=[Depends(require_key)])

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = await read_json(state, request, MessagesRequest)
        served = await state.resolve(req.model)
        thinks = resolve_reasoning_parser(state.config.reasoning_parser,
                                          served.client.tokenizer.chat_template) is not None
        try:
            chat = chat_request(req, thinks, req.max_tokens)
            call, group = await start_generation(state, served, chat)
        except APIError as e:
            raise renamed(e) from None
        assert isinstance(call, ChatCall)
        model, mid = served.name, message_id()
        if req.stream:
            return EngineStreamingResponse(_events(call, group, model, mid), group.close)
        result = await collect_unless_gone(group, 1, 1, request.receive)
        if result is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        whole = call.response(result, model, random_id(call.id_prefix), now())
        return JSONResponse(message(whole, model, mid))

    @router.post("/v1/messages/count_tokens")
    async def tokens(request: Request) -> Response:
        req = await read_json(state, request, CountTokensRequest)
        served = await state.resolve(req.model)
        with served.lease():
            try:
                n = await state.offload(count_tokens, req, served.client,
                                        state.config.tool_call_parser, reasoning_setup(state))
            except APIError as e:
                raise renamed(e) from None
        return JSONResponse({"input_tokens": n})

    return router


async def _events(call: ChatCall, group: RequestGroup, model: str,
                  mid: str) -> AsyncIterator[str]:
    """Anthropic's event stream of one answer; an engine failure ends it with an error
    event."""
    prompt = call.engine_prompts[0]
    input_tokens = len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else 0
    events = MessageEvents(call.chunks(model, random_id(call.id_prefix), now()), model, mid,
                           input_tokens)
    for e in events.opening():
        yield e
    usage = StreamUsage()
    try:
        async for index, out in group:
            usage.add(index, out)
            for e in events.feed(out):
                yield e
    except EngineDeadError as e:
        yield event("error", {"error": error_body(engine_error(e))["error"]})
        return
    for e in events.closing(usage.completion_tokens):
        yield e
