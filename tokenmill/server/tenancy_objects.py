"""Objects belong to the project that made them (ASGI middleware, inside the tenancy guard):
files, vector stores (with their files and file batches), stored responses and batches.

Who sees what, as with OpenAI's projects:
- a request made with a project key sees its project's objects only: every object id it
  names, in its path or in its JSON body (``file_id``, ``file_ids``, ``vector_store_ids``,
  ``previous_response_id``, at any depth), must be one its project made, else 404, the same
  answer as for an id that does not exist; the id of an object it creates is recorded as its
  project's (from the JSON answer, or the first event of a stream); its lists are paged over
  its own objects (``tenancy_lists``);
- the server key (``--api-key``) sees and may name every object; what it creates belongs to
  no project (OpenAI's "Default project"), so every project key gets 404 for it;
- on a server without ``--api-key``, a request without a project key is not trusted with
  the projects' objects: it sees, as a project would, only the objects of no project;
- the admin key is for the admin routes only (as OpenAI's admin keys).
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.api.errors import APIError
from tokenmill.server.tenancy_guard import send_error
from tokenmill.server.tenancy_lists import LISTS, scoped_list
from tokenmill.tenancy.meter import current_tab
from tokenmill.tenancy.store import TenancyStore

# An object id in a path: /v1/files/{id}..., /v1/vector_stores/{id}..., /v1/responses/{id}...
_PATH_ID = re.compile(r"^/v1/(?:files|vector_stores|responses|batches)/([^/]+)")
# POSTs whose answer is a new object of the caller's project.
_CREATES = re.compile(r"^/v1/(?:files|vector_stores|responses|batches)/?$")
_REF_KEYS = ("file_id", "file_ids", "vector_store_ids", "previous_response_id",
             "input_file_id")
# The first event of a stream names the new object; no need to read further.
_STREAM_ID = re.compile(rb'"id"\s*:\s*"((?:resp_|file-|vs_|batch_)[A-Za-z0-9_-]+)"')
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
    """Keep each project's files, vector stores and stored responses its own.
    ``server_key``: whether the server has an ``--api-key`` (without one, a request without
    a project key sees only the objects of no project)."""

    def __init__(self, app: ASGIApp, store: TenancyStore, server_key: bool = True) -> None:
        self.app = app
        self.store = store
        self.server_key = server_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tab = current_tab.get()
        path = scope.get("path", "")
        if (scope["type"] != "http" or not path.startswith("/v1/")
                or path.startswith("/v1/organization") or (tab is None and self.server_key)):
            await self.app(scope, receive, send)  # the server key (or a 401) sees everything
            return
        # The caller's project; None: the objects of no project.
        project_id = None if tab is None else tab.caller.project.id
        method = scope["method"]
        named = [m.group(1)] if (m := _PATH_ID.match(path)) else []
        receive, body = await read_json_body(scope, receive) if method == "POST" else (receive, None)
        if body is not None:
            named += _refs(body, [])
        missing = set(named) - self.store.owned(sorted(set(named)), project_id)
        if missing:
            await send_error(send, _not_found(sorted(missing)[0]), path)
            return
        if method == "GET" and path.rstrip("/") in LISTS:
            await scoped_list(self.app, scope, receive, send,
                              lambda ids: self.store.owned(ids, project_id))
            return
        if method == "POST" and _CREATES.match(path) and project_id is not None:
            send = self._recording(send, project_id)
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
