"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure,
and request-body parsing that turns any malformed input into one of them."""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error the API returns as-is: status, message, and OpenAI's ``param`` / ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        """The error as OpenAI's response body."""
        return ErrorResponse(error=ErrorInfo(
            message=self.message, type=_TYPES.get(self.status, "invalid_request_error"),
            param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status,
                            headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (404 route, 405, validation, crashes) OpenAI-shaped."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(str(exc)).response()

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or 413 once it exceeds ``max_bytes`` (checked before and while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {max_bytes}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body exceeds the limit of {max_bytes} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes, model: type[M]) -> M:
    """Decode UTF-8, parse JSON (no NaN / Infinity) and validate against ``model``; 400s name
    the first bad field."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    return validate_body(obj, model)


def validate_body(obj: dict[str, Any], model: type[M]) -> M:
    """Validate a parsed body against ``model``; the 400 names the first bad field."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        # OpenAI's param is the top-level field; the message keeps the full location.
        param = str(err["loc"][0]) if err["loc"] else None
        raise bad_request(f"{where}: {err['msg']}" if where else err["msg"], param) from None
