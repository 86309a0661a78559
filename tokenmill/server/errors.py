"""HTTP errors: an APIError as a JSON response (OpenAI's body, or Ollama's ``{"error": "..."}``
under ``/api/``), FastAPI's own errors and unhandled exceptions in the same shape, and a request
body read under a size limit (and parsed)."""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.api.anthropic import error_body as anthropic_error_body
from tokenmill.api.errors import APIError, bad_request, parse_json
from tokenmill.server.state import ServerState

M = TypeVar("M", bound=BaseModel)

logger = logging.getLogger(__name__)


def is_ollama_path(path: str) -> bool:
    """Whether ``path`` is one of Ollama's routes (``/api/...``), whose errors are Ollama's."""
    return path == "/api" or path.startswith("/api/")


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """The error's status, body and headers: Ollama's ``{"error": message}`` for a ``/api/``
    ``path``, Anthropic's for ``/v1/messages``, else OpenAI's."""
    if path.startswith("/v1/messages"):  # Anthropic's Messages API
        return JSONResponse(anthropic_error_body(err), status_code=err.status,
                            headers=err.headers)
    body = {"error": err.message} if is_ollama_path(path) else err.body().model_dump()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (404 route, 405, validation) and crashes the API's errors."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(bad_request(str(exc)), request.url.path)

    # Added first, so it is the innermost middleware: its 500 passes through the others
    # (x-request-id, CORS) like any answer.
    app.add_middleware(UnhandledErrors)


class UnhandledErrors:
    """ASGI middleware: an exception no route handled becomes a 500 with the API's error body,
    and the connection stays open for the client's next request.

    Starlette's own handler for ``Exception`` answers from the outermost layer, past every
    middleware (no x-request-id), and then re-raises, so uvicorn drops the keep-alive
    connection without a ``Connection: close``. An exception after the response started is
    re-raised: closing the connection is then the only way to end the half-sent answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            err = APIError(500, f"internal error: {type(exc).__name__}")
            await error_response(err, scope.get("path", ""))(scope, receive, send)


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (``application/json`` or ``*/*+json``): a browser
    page may post text/plain or a form to any address without asking, but not JSON."""
    declared = request.headers.get("content-type", "")
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        raise APIError(415, "the request body must be JSON sent with Content-Type: "
                       f"application/json, got {declared or 'no Content-Type'!r}",
                       param="content-type", code="unsupported_media_type")


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The body, or 413 once it exceeds ``max_bytes`` (checked before and while reading), or
    408 if it has not all arrived within ``timeout`` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {max_bytes}",
                       code="request_too_large")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, f"the request body exceeds the limit of {max_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None


async def read_json(state: ServerState, request: Request, model: type[M]) -> M:
    """The body as ``model``: 415 unless it is declared JSON, 413/408 for a body too large or
    too slow, 400 for anything ``parse_json`` refuses (parsed on a worker thread)."""
    check_json_content_type(request)
    config = state.config
    body = await read_body(request, config.max_body_bytes, config.body_timeout)
    return await state.offload(parse_json, body, model)
