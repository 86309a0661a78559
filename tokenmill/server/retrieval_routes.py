"""HTTP routes of OpenAI's Files and Vector Stores APIs over a RetrievalService:
``/v1/files`` and ``/v1/vector_stores`` with their files, file batches and search.

``retrieval_router`` returns them as one APIRouter; the app includes it with its auth
dependency. The service owns all state; these handlers only read requests and shape answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel

from tokenmill.api.errors import parse_json
from tokenmill.api.files import ListQuery, list_query
from tokenmill.api.vector_stores import (
    FileBatchCreate,
    SearchRequest,
    VectorStoreCreate,
    VectorStoreFileCreate,
    VectorStoreFileUpdate,
    VectorStoreUpdate,
)
from tokenmill.config import ServerConfig
from tokenmill.retrieval import RetrievalService
from tokenmill.server.errors import check_json_content_type, read_body
from tokenmill.server.retrieval_uploads import receive_upload

M = TypeVar("M", bound=BaseModel)
# Reads a JSON body as the given model (415 / 413 / 408 / 400 as the other routes do).
Reader = Callable[[Request, type[Any]], Awaitable[Any]]

# OpenAI's list limits: files up to 10,000 a page (and that by default), the rest 100 (20).
FILES_MAX_LIMIT = 10000
MAX_LIMIT, DEFAULT_LIMIT = 100, 20


@dataclass(frozen=True)
class RetrievalLimits:
    """``max_upload_bytes``: the largest file ``POST /v1/files`` takes (413 beyond);
    ``max_body_bytes`` / ``body_timeout``: the JSON bodies' limits, as for the other routes
    (``body_timeout`` also bounds how long an upload may stall)."""

    max_upload_bytes: int = 512 << 20
    max_body_bytes: int = 4 << 20
    body_timeout: float = 60.0


def retrieval_limits(config: ServerConfig) -> RetrievalLimits:
    """The limits a server's config sets (``--max-upload-bytes``, ``--max-body-bytes``...)."""
    return RetrievalLimits(config.max_upload_bytes, config.max_body_bytes, config.body_timeout)


def _json(obj: BaseModel) -> JSONResponse:
    return JSONResponse(obj.model_dump(mode="json"))


def _query(request: Request, max_limit: int = MAX_LIMIT,
           default_limit: int = DEFAULT_LIMIT) -> ListQuery:
    p = request.query_params
    return list_query(p.get("limit"), p.get("order"), p.get("after"), p.get("before"),
                      max_limit=max_limit, default_limit=default_limit)


def retrieval_router(service: RetrievalService,
                     limits: RetrievalLimits | None = None) -> APIRouter:
    """The Files and Vector Stores routes, answered by ``service``."""
    lim = limits or RetrievalLimits()
    router = APIRouter()

    async def body(request: Request, model: type[M]) -> M:
        check_json_content_type(request)
        raw = await read_body(request, lim.max_body_bytes, lim.body_timeout)
        return await asyncio.to_thread(parse_json, raw, model)

    _file_routes(router, service, lim)
    _store_routes(router, service, body)
    _store_file_routes(router, service, body)
    _batch_routes(router, service, body)
    return router


def _file_routes(router: APIRouter, service: RetrievalService, lim: RetrievalLimits) -> None:
    @router.post("/v1/files")
    async def create_file(request: Request) -> JSONResponse:
        path = service.upload_path()
        up = await receive_upload(request, path, lim.max_upload_bytes, lim.body_timeout)
        purpose = up.fields.get("purpose", "")
        return _json(await service.create_file(path, up.filename or "", purpose, up.size))

    @router.get("/v1/files")
    async def list_files(request: Request) -> JSONResponse:
        q = _query(request, FILES_MAX_LIMIT, FILES_MAX_LIMIT)
        return _json(await service.list_files(q, request.query_params.get("purpose")))

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> JSONResponse:
        return _json(await service.get_file(file_id))

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> JSONResponse:
        return _json(await service.delete_file(file_id))

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        path, filename = await service.file_path(file_id)
        return FileResponse(path, media_type="application/octet-stream", filename=filename)


def _store_routes(router: APIRouter, service: RetrievalService, read: Reader) -> None:

    @router.post("/v1/vector_stores")
    async def create_store(request: Request) -> JSONResponse:
        return _json(await service.create_store(await read(request, VectorStoreCreate)))

    @router.get("/v1/vector_stores")
    async def list_stores(request: Request) -> JSONResponse:
        return _json(await service.list_stores(_query(request)))

    @router.get("/v1/vector_stores/{store_id}")
    async def get_store(store_id: str) -> JSONResponse:
        return _json(await service.get_store(store_id))

    @router.post("/v1/vector_stores/{store_id}")
    async def update_store(store_id: str, request: Request) -> JSONResponse:
        req = await read(request, VectorStoreUpdate)
        return _json(await service.update_store(store_id, req))

    @router.delete("/v1/vector_stores/{store_id}")
    async def delete_store(store_id: str) -> JSONResponse:
        return _json(await service.delete_store(store_id))

    @router.post("/v1/vector_stores/{store_id}/search")
    async def search(store_id: str, request: Request) -> JSONResponse:
        req = await read(request, SearchRequest)
        return _json(await service.search_page(store_id, req))


def _store_file_routes(router: APIRouter, service: RetrievalService, read: Reader) -> None:
    base = "/v1/vector_stores/{store_id}/files"

    @router.post(base)
    async def attach(store_id: str, request: Request) -> JSONResponse:
        req = await read(request, VectorStoreFileCreate)
        return _json(await service.attach_file(store_id, req))

    @router.get(base)
    async def list_store_files(store_id: str, request: Request) -> JSONResponse:
        return _json(await service.list_store_files(
            store_id, _query(request), request.query_params.get("filter")))

    @router.get(base + "/{file_id}")
    async def get_store_file(store_id: str, file_id: str) -> JSONResponse:
        return _json(await service.get_store_file(store_id, file_id))

    @router.post(base + "/{file_id}")
    async def update_store_file(store_id: str, file_id: str, request: Request) -> JSONResponse:
        req = await read(request, VectorStoreFileUpdate)
        return _json(await service.update_store_file(store_id, file_id, req.attributes))

    @router.delete(base + "/{file_id}")
    async def detach(store_id: str, file_id: str) -> JSONResponse:
        return _json(await service.detach_file(store_id, file_id))

    @router.get(base + "/{file_id}/content")
    async def store_file_content(store_id: str, file_id: str) -> JSONResponse:
        return _json(await service.store_file_content(store_id, file_id))


def _batch_routes(router: APIRouter, service: RetrievalService, read: Reader) -> None:
    base = "/v1/vector_stores/{store_id}/file_batches"

    @router.post(base)
    async def create_batch(store_id: str, request: Request) -> JSONResponse:
        req = await read(request, FileBatchCreate)
        return _json(await service.create_batch(store_id, req))

    @router.get(base + "/{batch_id}")
    async def get_batch(store_id: str, batch_id: str) -> JSONResponse:
        return _json(await service.get_batch(store_id, batch_id))

    @router.post(base + "/{batch_id}/cancel")
    async def cancel_batch(store_id: str, batch_id: str) -> JSONResponse:
        return _json(await service.cancel_batch(store_id, batch_id))

    @router.get(base + "/{batch_id}/files")
    async def batch_files(store_id: str, batch_id: str, request: Request) -> JSONResponse:
        await service.get_batch(store_id, batch_id)
        return _json(await service.list_store_files(
            store_id, _query(request), request.query_params.get("filter"), batch_id))
