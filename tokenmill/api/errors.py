"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure,
and the parsing of a request body that turns any malformed input into one of them."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tokenmill.api.protocol import ErrorInfo, ErrorResponse

M = TypeVar("M", bound=BaseModel)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error the API returns as-is: status, message, and OpenAI's ``param`` / ``code``;
    ``headers`` go with it when it is answered over HTTP."""

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


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def loads_json(text: str) -> Any:
    """``json.loads`` without NaN / Infinity, which JSON does not have, nested at most
    ``MAX_JSON_DEPTH`` levels and with no lone surrogate (``"\\ud800"``, which no UTF-8 text
    can hold) in any string; ValueError naming what is wrong otherwise."""
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"it is nested more than {MAX_JSON_DEPTH} levels deep") from None
    # Text decoded from UTF-8 holds no surrogate: only a \uD8xx-\uDFxx escape can make one.
    check_json_tree(obj, check_strings=_SURROGATE_ESCAPE.search(text) is not None)
    return obj


# Deeper than any request needs, shallow enough for every recursive step after parsing.
MAX_JSON_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def check_json_tree(obj: Any, check_strings: bool = True) -> None:
    """ValueError if ``obj`` nests deeper than MAX_JSON_DEPTH or (``check_strings``) holds a
    string, key or value, that is not valid Unicode text. Walks without recursion, so any
    depth is safe, and visits only containers unless strings are to be checked: a body of
    100,000 messages costs a few tens of milliseconds."""
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"it is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(node, dict):
            if check_strings and not all(_is_text(k) for k in node):
                _bad_text(obj)
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:  # a scalar body
            if check_strings and isinstance(node, str) and not _is_text(node):
                _bad_text(obj)
            continue
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
            elif check_strings and isinstance(child, str) and not _is_text(child):
                _bad_text(obj)


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_text(obj: Any) -> None:
    try:
        _raise_bad_text(obj)
    except RecursionError:  # deep, but within json.loads' limit: name no place
        pass
    raise ValueError("a string in the body holds a lone surrogate, which is not valid "
                     "Unicode text")


def _raise_bad_text(obj: Any, where: str = "") -> None:
    """Find the first string of ``obj`` that is not valid text and raise a ValueError naming
    where it is (the slow path, taken only once such a string is known to be there)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where or 'the body'} holds a lone surrogate "
                             f"(U+{ord(obj[e.start]):04X} at character {e.start}), "
                             f"which is not valid Unicode text") from None
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if not _is_text(key):
                raise ValueError(f"a key in {where or 'the body'} holds a lone surrogate, "
                                 "which is not valid Unicode text")
            _raise_bad_text(value, f"{where}.{key}" if where else key)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            _raise_bad_text(value, f"{where}[{i}]")


def parse_json(body: bytes, model: type[M]) -> M:
    """Decode UTF-8, parse JSON (no NaN / Infinity) and validate against ``model``; 400s name
    the first bad field."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = loads_json(text)
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
