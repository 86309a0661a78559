"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}: check the
request (in api/), run the file_search tool's search with the retrieval service the server was
given, generate, answer whole or as typed server-sent events, and keep the response when
``store`` asks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.api.errors import APIError, bad_request, parse_json
from tokenmill.api.file_search import SearchFn, result_of
from tokenmill.api.protocol import now
from tokenmill.api.response_store import ResponseStore, StoredResponse
from tokenmill.api.responses_api import (
    ResponsePlan,
    ResponsesCall,
    conversation,
    plan_response,
    prepare_response,
)
from tokenmill.api.responses_protocol import (
    DeletedResponse,
    FileSearchResult,
    ResponseObject,
    ResponsesRequest,
)
from tokenmill.api.responses_stream import Event, ResponseBuilder, item_id
from tokenmill.engine.async_llm import EngineDeadError, RequestGroup
from tokenmill.server.errors import check_json_content_type, read_body
from tokenmill.server.openapi import json_body
from tokenmill.server.serving import reasoning_setup, submit
from tokenmill.server.state import ServerState
from tokenmill.server.streaming import EngineStreamingResponse, until_disconnect


def responses_router(state: ServerState, search: SearchFn | None = None,
                     store: ResponseStore | None = None) -> APIRouter:
    """The Responses API's routes. ``search``: the retrieval service's search, which the
    file_search tool needs (without it such a request is a 400); ``store``: where stored
    responses are kept (a new in-memory store by default)."""
    responses = store if store is not None else ResponseStore()
    router = APIRouter()

    @router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
    async def create(request: Request) -> Response:
        check_json_content_type(request)
        config = state.config
        body = await read_body(request, config.max_body_bytes, config.body_timeout)
        req = await state.offload(parse_json, body, ResponsesRequest)
        return await create_response(state, req, request, search, responses)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(responses.get(response_id).response.model_dump(mode="json"))

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        responses.delete(response_id)
        return JSONResponse(DeletedResponse(id=response_id).model_dump())

    return router


async def run_search(plan: ResponsePlan, search: SearchFn | None) -> list[FileSearchResult]:
    """The file_search tool's results for the plan's question, best first (none scoring
    under ``ranking_options.score_threshold``); 400 when this server has no retrieval
    service, the retrieval service's 4xx (404: an unknown vector store) otherwise."""
    tool = plan.tools.file_search
    assert tool is not None and plan.query is not None
    if search is None:
        raise bad_request("the file_search tool needs vector stores, which this server does "
                          "not serve", "tools")
    threshold = tool.ranking_options.score_threshold if tool.ranking_options else None
    try:
        hits = await search(list(tool.vector_store_ids), plan.query, tool.max_num_results,
                            filters=tool.filters, score_threshold=threshold or 0.0)
    except APIError as e:
        # The retrieval service names its own fields; here they are the tool's.
        raise APIError(e.status, e.message, param="tools", code=e.code) from None
    return [result_of(h) for h in hits]


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request,
                          search: SearchFn | None, store: ResponseStore) -> Response:
    """Check, search, submit and answer one Responses request."""
    served = state.model(req.model)
    history = store.get(req.previous_response_id, "previous_response_id").conversation \
        if req.previous_response_id is not None else []
    with served.lease():  # held until the engine has the request
        plan = await state.offload(plan_response, req, history)
        results = await run_search(plan, search) if plan.query is not None else None
        call: ResponsesCall = await state.offload(
            prepare_response, plan, served.client, results, state.config.tool_call_parser,
            reasoning_setup(state))
        group = await submit(state, served, call.chat.engine_prompts, call.chat.params,
                             "resp")
    builder = ResponseBuilder(call, call.skeleton(item_id("resp"), served.name, now()))

    def keep(response: ResponseObject) -> None:
        if req.store and response.status in ("completed", "incomplete"):
            store.put(StoredResponse(response, conversation(call, response)))

    if req.stream:
        return EngineStreamingResponse(_stream(builder, group, keep), group.close)
    try:
        done = await until_disconnect(raw.receive, _run(builder, group))
    finally:
        group.close()
    if done is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    error = builder.response.error
    if error is not None:  # as chat's answer is when the engine fails under it
        raise APIError(500, error.message, code="engine_error")
    keep(builder.response)
    return JSONResponse(builder.response.model_dump(mode="json"))


async def _run(builder: ResponseBuilder, group: RequestGroup) -> bool:
    """Build the whole response from the group's outputs (the events are not sent)."""
    builder.start()
    try:
        async for _, out in group:
            builder.feed(out)
    except EngineDeadError as e:
        builder.fail(str(e))
        return True
    builder.finish()
    return True


def _sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _stream(builder: ResponseBuilder, group: RequestGroup,
                  keep: Callable[[ResponseObject], None]) -> AsyncIterator[str]:
    """The response's events as server-sent events; an engine failure ends the stream with
    response.failed."""
    for event in builder.start():
        yield _sse(event)
    try:
        async for _, out in group:
            for event in builder.feed(out):
                yield _sse(event)
    except EngineDeadError as e:
        for event in builder.fail(str(e)):
            yield _sse(event)
        return
    for event in builder.finish():
        yield _sse(event)
    keep(builder.response)
