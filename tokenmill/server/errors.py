"""OpenAI-shaped HTTP errors: an APIError as a JSON response, FastAPI's own errors in the same
shape, and a request body read under a size limit (and parsed)."""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.api.errors import APIError, bad_request, parse_json
from tokenmill.server.state import ServerState

M = TypeVar("M", bound=BaseModel)

logger = logging.getLogger(__name__)


def error_response(err: APIError) -> JSONResponse:
    """The error's status, OpenAI body and headers."""
    return JSONResponse(err.body().model_dump(), status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (404 route, 405, validation, crashes) OpenAI-shaped."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(bad_request(str(exc)))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))


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
