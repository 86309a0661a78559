"""The audit log's records of what the admin key does to models (ASGI middleware): a model
loaded, swapped or unloaded through ``/admin/models``, a LoRA adapter loaded or unloaded.
One record per action that succeeded (a 2xx answer); a refused action leaves none."""

from __future__ import annotations

import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.tenancy_objects import read_json_body
from tokenmill.tenancy.store import TenancyStore

ACTOR = "admin_key"
_MODEL_PATH = re.compile(r"^/admin/models(?:/(?P<name>.+))?$")
_ACTIONS = {("POST", False): "model.loaded", ("PUT", True): "model.swapped",
            ("DELETE", True): "model.unloaded"}
_LORA = {"/v1/load_lora_adapter": "lora.loaded", "/v1/unload_lora_adapter": "lora.unloaded"}


def _action(method: str, path: str) -> str | None:
    if path in _LORA and method == "POST":
        return _LORA[path]
    m = _MODEL_PATH.match(path)
    return None if m is None else _ACTIONS.get((method, m.group("name") is not None))


class AdminAudit:
    """Append an audit record for each model action that succeeds."""

    def __init__(self, app: ASGIApp, store: TenancyStore) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = _action(scope.get("method", ""), scope.get("path", "")) if (
            scope["type"] == "http") else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        receive, body = await read_json_body(scope, receive)
        m = _MODEL_PATH.match(scope["path"])
        details: dict[str, Any] = {"name": (m.group("name") if m and m.group("name") else None)}
        if isinstance(body, dict):
            details["name"] = details["name"] or body.get("name") or body.get("lora_name")
            if "path" in body or "lora_path" in body:
                details["path"] = body.get("path") or body.get("lora_path")

        async def auditing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and 200 <= message["status"] < 300:
                self.store.audit(kind, None, ACTOR, details)
            await send(message)

        await self.app(scope, receive, auditing_send)
