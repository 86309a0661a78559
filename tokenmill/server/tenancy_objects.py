"""Objects belong to the project that made them (ASGI middleware, inside the tenancy guard):
files, vector stores (with their files and file batches) and stored responses.

For a request made with a project key:
- every object id it names, in its path or in its JSON body (``file_id``, ``file_ids``,
  ``vector_store_ids``, ``previous_response_id``, at any depth), must be one its project made,
  else 404, the same answer as for an id that does not exist;
- the id of an object it creates is recorded as its project's (from the JSON answer, or the
  first event of a stream);
- lists of files and vector stores show only its project's.
Requests made with the server key see everything, as before projects existed.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.api.errors import APIError
from tokenmill.server.tenancy_guard import send_error
from tokenmill.tenancy.meter import current_tab
from tokenmill.tenancy.store import TenancyStore

# An object id in a path: /v1/files/{id}..., /v1/vector_stores/{id}..., /v1/responses/{id}...
_PATH_ID = re.compile(r"^/v1/(?:files|vector_stores|responses)/([^/]+)")
# POSTs whose answer is a new object of the caller's project.
_CREATES = re.compile(r"^/v1/(?:files|vector_stores|responses)/?$")
# GETs whose answer is a list to narrow to the caller's project.
_LISTS = ("/v1/files", "/v1/vector_stores")
_REF_KEYS = ("file_id", "file_ids", "vector_store_ids", "previous_response_id")
# The first event of a stream names the new object; no need to read further.
_STREAM_ID = re.compile(rb'"id"\s*:\s*"((?:resp_|file-|vs_)[A-Za-z0-9_-]+)"')
# JSON bodies up to this size are read to check the ids they name.
MAX_INSPECTED_BYTES = 16 << 20


def _refs(obj: Any, out: list[str]) -> list[str]:
    """Every object id ``obj`` names under one of _REF_KEYS, at any depth."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in _REF_KEYS and isinstance(v, str):
                out.append(v)
            elif k in _REF_KEYS and isinstance(v, list):
                out += [x for x in v if isinstance(x, str)]
            else:
                _refs(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _refs(v, out)
    return out


def _not_found(object_id: str) -> APIError:
    return APIError(404, f"no object with id {object_id!r}", code="not_found")


class ObjectGuard:
    """Keep each project's files, vector stores and stored responses its own."""

    def __init__(self, app: ASGIApp, store: TenancyStore) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tab = current_tab.get()
        path = scope.get("path", "")
        if scope["type"] != "http" or tab is None or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        project_id = tab.caller.project.id
        method = scope["method"]
        named = [m.group(1)] if (m := _PATH_ID.match(path)) else []
        receive, body = await read_json_body(scope, receive) if method == "POST" else (receive, None)
        if body is not None:
            named += _refs(body, [])
        missing = set(named) - self.store.owned(sorted(set(named)), project_id)
        if missing:
            await send_error(send, _not_found(sorted(missing)[0]), path)
            return
        if method == "POST" and _CREATES.match(path):
            send = self._recording(send, project_id)
        elif method == "GET" and path.rstrip("/") in _LISTS:
            send = self._narrowing(send, project_id)
        await self.app(scope, receive, send)

    def _recording(self, send: Send, project_id: str) -> Send:
        """``send`` that records the id of the object the answer creates."""
        state = {"status": 0, "head": b"", "done": False}

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body" and not state["done"]:
                state["head"] += message.get("body", b"")
                found = _STREAM_ID.search(state["head"])
                if found and state["status"] == 200:
                    self.store.set_owner(found.group(1).decode(), project_id)
                    state["done"] = True
                elif len(state["head"]) > 1 << 16:
                    state["done"] = True
            await send(message)

        return recording_send

    def _narrowing(self, send: Send, project_id: str) -> Send:
        """``send`` whose list answer keeps only the project's objects."""
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def narrowing_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            if start.get("status") == 200:
                body = self._narrowed(body, project_id)
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return narrowing_send

    def _narrowed(self, body: bytes, project_id: str) -> bytes:
        page = json.loads(body)
        data = page.get("data", [])
        mine = self.store.owned([o["id"] for o in data], project_id)
        page["data"] = [o for o in data if o["id"] in mine]
        page["first_id"] = page["data"][0]["id"] if page["data"] else None
        page["last_id"] = page["data"][-1]["id"] if page["data"] else None
        return json.dumps(page).encode()


async def read_json_body(scope: Scope, receive: Receive) -> tuple[Receive, Any]:
    """Read a JSON body (up to MAX_INSPECTED_BYTES) and a ``receive`` that replays it; the
    parsed body, or None when it is not JSON (the route then answers as it would)."""
    content_type = dict(scope.get("headers", [])).get(b"content-type", b"")
    if not content_type.split(b";")[0].strip().lower().endswith(b"json"):
        return receive, None
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if not message.get("more_body") or size > MAX_INSPECTED_BYTES:
            break

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    complete = messages[-1]["type"] == "http.request" and not messages[-1].get("more_body")
    if not complete:
        return replay, None
    try:
        body = json.loads(b"".join(m.get("body", b"") for m in messages))
    except ValueError:
        return replay, None
    return replay, body
