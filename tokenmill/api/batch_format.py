"""The OpenAI Batch API's JSONL format: input lines in, output lines out.

An input line is ``{"custom_id", "method": "POST", "url", "body"}``; its output line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. A body the
endpoint rejects gets its HTTP status and OpenAI error body in ``response`` (as the server would
answer); a line that is not a request at all (bad JSON, no custom_id, unknown url) gets
``response: null`` and ``error``. The output ``id`` is derived from the line number, so a
resumed job can tell which lines a killed run already answered, whether or not they had a
usable custom_id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tokenmill.api.endpoints import ENDPOINTS
from tokenmill.api.errors import APIError, loads_json


@dataclass(frozen=True)
class BatchRequest:
    """One input line that names a request: the body is checked later, by the engine's side."""

    line: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    """One input line that is not a request; it is answered with an error line."""

    line: int
    custom_id: str | None  # when the line had a usable one
    message: str


class BatchResponse(BaseModel):
    status_code: int
    request_id: str | None = None
    body: dict[str, Any]


class BatchError(BaseModel):
    code: str
    message: str


class BatchOutput(BaseModel):
    """One output line."""

    id: str
    custom_id: str | None
    response: BatchResponse | None = None
    error: BatchError | None = None


def output_id(line: int) -> str:
    """The output ``id`` of an input line: stable across runs, so resuming can match it."""
    return f"batch_req_{line}"


def parse_line(line: int, raw: bytes) -> BatchRequest | LineError:
    """Check one input line's envelope; the error message names the line and the field."""
    try:
        obj = loads_json(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return LineError(line, None, f"line {line}: not valid UTF-8 (byte {e.start})")
    except ValueError as e:
        return LineError(line, None, f"line {line}: not valid JSON: {e}")
    if not isinstance(obj, dict):
        return LineError(line, None, f"line {line}: must be a JSON object, got {_kind(obj)}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line, None,
                         f"line {line}: custom_id must be a non-empty string, got {custom_id!r}")

    def error(message: str) -> LineError:
        return LineError(line, custom_id, f"line {line}: {message}")

    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        return error(f"method must be 'POST', got {method!r}")
    if url not in ENDPOINTS:
        return error(f"url must be one of {sorted(ENDPOINTS)}, got {url!r}")
    if not isinstance(body, dict):
        return error(f"body must be a JSON object, got {_kind(body)}")
    return BatchRequest(line, custom_id, url, body)


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def error_line(err: LineError) -> str:
    """The output line of an input line that is not a request."""
    return BatchOutput(id=output_id(err.line), custom_id=err.custom_id,
                       error=BatchError(code="invalid_request", message=err.message)
                       ).model_dump_json()


def response_line(req: BatchRequest, body: BaseModel, request_id: str | None) -> str:
    """The output line of an answered request (status 200)."""
    return BatchOutput(id=output_id(req.line), custom_id=req.custom_id,
                       response=BatchResponse(status_code=200, request_id=request_id,
                                              body=body.model_dump())).model_dump_json()


def api_error_line(req: BatchRequest, err: APIError) -> str:
    """The output line of a request the endpoint refused: the status and body the server
    would have answered with."""
    return BatchOutput(id=output_id(req.line), custom_id=req.custom_id,
                       response=BatchResponse(status_code=err.status,
                                              body=err.body().model_dump())).model_dump_json()
