"""The FastAPI application: OpenAI-compatible inference routes, tokenizer routes, health and
Prometheus metrics. ``build_app`` wires routes to a ServerState; launcher.py runs it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.api.errors import APIError, parse_json
from tokenmill.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from tokenmill.api.tokens import detokenize, tokenize
from tokenmill.api.validation import check_model
from tokenmill.server.errors import install_error_handlers, read_body
from tokenmill.server.serving import create_response
from tokenmill.server.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    """The application; its lifespan starts and stops the engine thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        yield
        await state.client.shutdown()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.tokenmill = state
    install_error_handlers(app)

    async def require_key(request: Request) -> None:
        if not state.key_matches(request.headers.get("authorization")):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def require_key_if_configured(request: Request) -> None:
        if state.config.auth_health_metrics:
            await require_key(request)

    app.include_router(_inference_routes(state), dependencies=[Depends(require_key)])
    app.include_router(_open_routes(state), dependencies=[Depends(require_key_if_configured)])
    return app


def _inference_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    limit = state.config.max_body_bytes

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_json(await read_body(request, limit), ChatCompletionRequest)
        return await create_response(state, req, request)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_json(await read_body(request, limit), CompletionRequest)
        return await create_response(state, req, request)

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=state.model_name, created=state.created,
                         max_model_len=state.client.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        req = parse_json(await read_body(request, limit), TokenizeRequest)
        check_model(state.model_name, req.model)
        return JSONResponse(tokenize(req, state.client).model_dump())

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        req = parse_json(await read_body(request, limit), DetokenizeRequest)
        check_model(state.model_name, req.model)
        return JSONResponse(detokenize(req, state.client).model_dump())

    return router


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        if state.serving:
            return JSONResponse({"status": "ok"})
        reason = state.client.dead_reason or ("shutting down" if state.draining else "starting")
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @router.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    return router
