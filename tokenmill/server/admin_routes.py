"""The admin API: list, load, unload and swap models while serving (``--admin-key``).

The routes exist only when the server has an admin key, and answer only requests that bear it
(``Authorization: Bearer <admin key>``; the user API key does not open them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.api.errors import APIError, parse_json
from tokenmill.server.errors import check_json_content_type, read_body
from tokenmill.server.lifecycle import LoadRequest, ModelManager
from tokenmill.server.state import ServerState, bearer_token


class LoadModelBody(BaseModel):
    """POST /admin/models."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)


class SwapModelBody(BaseModel):
    """PUT /admin/models/{name}."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)


def admin_key_check(state: ServerState) -> Callable[[Request], Awaitable[None]]:
    """A route dependency that lets only requests bearing the admin key through (401)."""
    key = state.config.admin_key
    assert key is not None

    async def require_admin_key(request: Request) -> None:
        given = bearer_token(request.headers.get("authorization"))
        if given is None or not _same(given, key):
            raise APIError(401, "missing or invalid admin key (send Authorization: Bearer "
                           "<admin key>)", code="invalid_admin_key")

    return require_admin_key


def admin_router(state: ServerState, manager: ModelManager) -> APIRouter:
    """The /admin routes, behind the admin key."""
    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_key_check(state))])

    async def body_of(request: Request, model: type[BaseModel]) -> Any:
        check_json_content_type(request)
        raw = await read_body(request, state.config.max_body_bytes, state.config.body_timeout)
        return await state.offload(parse_json, raw, model)

    @router.get("/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": manager.describe()})

    @router.post("/models")
    async def load_model(request: Request) -> JSONResponse:
        body = await body_of(request, LoadModelBody)
        await manager.load(LoadRequest(body.name, body.path, body.options))
        return JSONResponse(_one(manager, body.name), status_code=201)

    @router.put("/models/{name:path}")
    async def swap_model(name: str, request: Request) -> JSONResponse:
        body = await body_of(request, SwapModelBody)
        await manager.swap(LoadRequest(name, body.path, body.options))
        return JSONResponse(_one(manager, name))

    @router.delete("/models/{name:path}")
    async def unload_model(name: str) -> JSONResponse:
        await manager.unload(name)
        return JSONResponse({"name": name, "object": "model", "deleted": True})

    return router


def _one(manager: ModelManager, name: str) -> dict[str, Any]:
    return next(m for m in manager.describe() if m["name"] == name)


def _same(given: str, key: str) -> bool:
    import hmac
    return hmac.compare_digest(given.encode(), key.encode())
