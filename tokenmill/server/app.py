"""The FastAPI application: OpenAI-compatible inference routes, tokenizer routes, health and
Prometheus metrics. ``build_app`` wires routes to a ServerState; launcher.py runs it."""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from tokenmill.api.classify import ClassifyRequest
from tokenmill.api.embeddings import EmbeddingRequest
from tokenmill.api.errors import APIError
from tokenmill.api.file_search import SearchFn
from tokenmill.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from tokenmill.api.responses_protocol import ResponsesRequest
from tokenmill.api.scores import RerankRequest, ScoreRequest, prepare_rerank, prepare_score
from tokenmill.api.tokens import detokenize, tokenize, tokenizer_info
from tokenmill.retrieval.service import RetrievalService
from tokenmill.server.admin_routes import admin_key_check, admin_router
from tokenmill.server.anthropic_routes import anthropic_router
from tokenmill.server.batch_routes import batch_router
from tokenmill.server.classify import create_classification
from tokenmill.server.embeddings import create_embeddings
from tokenmill.server.errors import install_error_handlers, read_json
from tokenmill.server.guard import HostPolicy, RequestGuard
from tokenmill.server.lifecycle import ModelManager
from tokenmill.server.lora_adapters import lora_router
from tokenmill.server.monitoring import monitor_router
from tokenmill.server.ollama_routes import ollama_router
from tokenmill.server.openapi import install_openapi, json_body
from tokenmill.server.organization_routes import install_tenancy
from tokenmill.server.request_id import RequestIdMiddleware
from tokenmill.server.responses_routes import responses_router
from tokenmill.server.retrieval_routes import retrieval_limits, retrieval_router
from tokenmill.server.serving import create_response
from tokenmill.server.state import ServedModel, ServerState
from tokenmill.server.webui_routes import stats_router, webui_router
from tokenmill.tenancy.meter import current_tab
from tokenmill.tenancy.retention import TenancySettings


def build_app(state: ServerState, manager: ModelManager | None = None,
              retrieval: RetrievalService | None = None,
              tenancy: TenancySettings | None = None,
              file_search: SearchFn | None = None) -> FastAPI:
    """The application; its lifespan starts and stops the engines. ``manager``: the admin API's
    model manager (its routes exist only when the server has an admin key); ``retrieval``: the
    files and vector stores (their routes and the file_search tool exist only with it);
    ``tenancy``: the projects' options (tokenmill/tenancy; defaults when None);
    ``file_search``: the file_search tool's search when the stores are elsewhere (a Ray Serve
    replica's: the ingress keeps them)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for client in state.clients:
            client.start()
        if manager is not None:
            manager.start()
        if retrieval is not None:
            await retrieval.start()
        yield
        if retrieval is not None:
            await retrieval.close()
        if manager is not None:
            await manager.stop()
        for client in state.clients:
            await client.shutdown()
        state.workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    install_openapi(app, [ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                          DetokenizeRequest, ClassifyRequest, EmbeddingRequest,
                          ScoreRequest, RerankRequest, ResponsesRequest], _version())
    app.state.tokenmill = state
    install_error_handlers(app)

    async def require_key(request: Request) -> None:
        # A project key was checked by the tenancy guard (organization_routes.py).
        if current_tab.get() is None and not state.key_matches(
                request.headers.get("authorization")):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def require_key_if_configured(request: Request) -> None:
        if state.config.auth_health_metrics:
            await require_key(request)

    app.include_router(_inference_routes(state), dependencies=[Depends(require_key)])
    search = retrieval.search if retrieval is not None else file_search
    app.include_router(responses_router(state, search), dependencies=[Depends(require_key)])
    if retrieval is not None:
        app.include_router(retrieval_router(retrieval, retrieval_limits(state.config)),
                           dependencies=[Depends(require_key)])
        app.include_router(batch_router(retrieval, state), dependencies=[Depends(require_key)])
    app.include_router(_open_routes(state), dependencies=[Depends(require_key_if_configured)])
    app.include_router(ollama_router(state), dependencies=[Depends(require_key)])
    app.include_router(anthropic_router(state))  # its own key check: x-api-key
    app.include_router(stats_router(state, require_key))
    # Loading adapters reads folders on the server: with an admin key, only it may.
    lora_auth = admin_key_check(state) if state.config.admin_key is not None else require_key
    app.include_router(lora_router(state, lora_auth))
    if state.config.webui:
        app.include_router(webui_router())
    if state.config.admin_key is not None:
        if manager is None:
            raise ValueError("an admin key needs a model manager")
        app.include_router(admin_router(state, manager))
        if state.monitors is not None:
            app.include_router(monitor_router(state, state.monitors))
    install_tenancy(app, state, tenancy)
    config = state.config
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    # Added after the others, so it runs before them: nothing (CORS preflights included)
    # answers a foreign Host.
    app.add_middleware(RequestGuard, policy=HostPolicy(config.host, config.allowed_hosts,
                                                      config.allowed_origins))
    # Outermost: every answer carries the id, the guard's refusals and crashes' 500s too.
    app.add_middleware(RequestIdMiddleware)
    return app


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _inference_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        req = await read_json(state, request, ChatCompletionRequest)
        return await create_response(state, req, request)

    @router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        req = await read_json(state, request, CompletionRequest)
        return await create_response(state, req, request)

    @router.post("/v1/classify", openapi_extra=json_body(ClassifyRequest))
    async def classify(request: Request) -> Response:
        req = await read_json(state, request, ClassifyRequest)
        return await create_classification(state, req, request)

    @router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        req = await read_json(state, request, EmbeddingRequest)
        return await create_embeddings(state, req, request)

    # vLLM serves both at these paths too (/v2/rerank: Cohere's client).
    @router.post("/v1/score", openapi_extra=json_body(ScoreRequest))
    @router.post("/score", openapi_extra=json_body(ScoreRequest))
    async def score(request: Request) -> Response:
        req = await read_json(state, request, ScoreRequest)
        return await create_embeddings(state, req, request, prepare_score)

    @router.post("/v1/rerank", openapi_extra=json_body(RerankRequest))
    @router.post("/rerank", openapi_extra=json_body(RerankRequest))
    @router.post("/v2/rerank", openapi_extra=json_body(RerankRequest))
    async def rerank(request: Request) -> Response:
        req = await read_json(state, request, RerankRequest)
        return await create_embeddings(state, req, request, prepare_rerank)

    def card(served: ServedModel) -> ModelCard:
        # An adapter names its base and its folder, as vLLM's cards do.
        return ModelCard(id=served.name, created=state.created,
                         max_model_len=served.client.max_model_len,
                         parent=served.base.name if served.base is not None else None,
                         root=served.path if served.base is not None else None)

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [card(m) for m in [*state.models.values(), *state.adapters.values()]]
        return JSONResponse(ModelList(data=cards).model_dump(exclude_none=True))

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        return JSONResponse(card(state.model(model_id, task=None)).model_dump(exclude_none=True))

    @router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
    async def tokenize_route(request: Request) -> JSONResponse:
        req = await read_json(state, request, TokenizeRequest)
        with (await state.resolve(req.model, task=None)).lease() as served:
            answer = await state.offload(tokenize, req, served.client)
        return JSONResponse(answer.model_dump())

    @router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> JSONResponse:
        req = await read_json(state, request, DetokenizeRequest)
        with (await state.resolve(req.model, task=None)).lease() as served:
            answer = await state.offload(detokenize, req, served.client)
        return JSONResponse(answer.model_dump())

    @router.get("/tokenizer_info")
    async def tokenizer_info_route(model: str | None = None) -> JSONResponse:
        with (await state.resolve(model, task=None)).lease() as served:
            return JSONResponse(tokenizer_info(served.client))

    return router


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        if state.serving:
            return JSONResponse({"status": "ok"})
        reason = state.dead_reason or ("shutting down" if state.draining else "starting")
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": _version()})

    @router.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    return router
