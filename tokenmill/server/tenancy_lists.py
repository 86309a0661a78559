"""A project's lists (files, vector stores, batches) paged over its own objects.

Narrowing a page after the route has cut it would answer a short or empty page with
``has_more`` and wrong cursors whenever other projects' objects sit in between; so the list
is read from the route in its largest pages, from the caller's cursor on, keeping only what
the caller may see, until one more than ``limit`` are found or the list ends."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.files import list_query
from tokenmill.server.retrieval_routes import DEFAULT_LIMIT, FILES_MAX_LIMIT, MAX_LIMIT
from tokenmill.server.tenancy_guard import send_error

# Each list route and its (largest, default) page size, as the route itself takes them.
LISTS: dict[str, tuple[int, int]] = {
    "/v1/files": (FILES_MAX_LIMIT, FILES_MAX_LIMIT),
    "/v1/vector_stores": (MAX_LIMIT, DEFAULT_LIMIT),
    "/v1/batches": (MAX_LIMIT, DEFAULT_LIMIT),
}

Visible = Callable[[list[str]], set[str]]


async def _call(app: ASGIApp, scope: Scope, receive: Receive, query: list[tuple[str, str]]
                ) -> tuple[int, bytes]:
    """One GET of the route with ``query``: its status and body."""
    sub = {**scope, "query_string": urlencode(query).encode()}
    sent = False
    out: dict[str, Any] = {"status": 500, "body": b""}

    async def once() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await receive()

    async def collect(message: Message) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    await app(sub, once, collect)
    return out["status"], out["body"]


def _checked(path: str, params: dict[str, str], visible: Visible) -> Any:
    """The list query, checked as the route checks it; a cursor the caller may not see is
    the same 400 as an unknown one."""
    max_limit, default_limit = LISTS[path]
    q = list_query(params.get("limit"), params.get("order"), params.get("after"),
                   params.get("before"), max_limit=max_limit, default_limit=default_limit)
    for name, cursor in (("after", q.after), ("before", q.before)):
        if cursor is not None and not visible([cursor]):
            raise bad_request(f"{name}: {cursor!r} is not an id in this list", name)
    return q


async def scoped_list(app: ASGIApp, scope: Scope, receive: Receive, send: Send,
                      visible: Visible) -> None:
    """Answer the list GET in ``scope`` with only the objects ``visible`` keeps."""
    path = scope["path"].rstrip("/")
    pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    params = dict(pairs)
    try:
        q = _checked(path, params, visible)
    except APIError as e:
        await send_error(send, e, path)
        return
    rest = [(k, v) for k, v in pairs if k not in ("limit", "after")]
    found: list[dict[str, Any]] = []
    after = q.after
    while True:
        query = [*rest, ("limit", str(LISTS[path][0]))] + ([("after", after)] if after else [])
        status, body = await _call(app, scope, receive, query)
        if status != 200:  # the route's own refusal, as it gave it
            await _send_json(send, status, body)
            return
        page = json.loads(body)
        data = page.get("data", [])
        keep = visible([o["id"] for o in data])
        found += [o for o in data if o["id"] in keep]
        if len(found) > q.limit or not page.get("has_more") or not data:
            break
        after = data[-1]["id"]
    page["data"] = found[:q.limit]
    page["first_id"] = page["data"][0]["id"] if page["data"] else None
    page["last_id"] = page["data"][-1]["id"] if page["data"] else None
    page["has_more"] = len(found) > q.limit
    await _send_json(send, 200, json.dumps(page).encode())


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
