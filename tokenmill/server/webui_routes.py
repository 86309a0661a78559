"""The web page: a chat playground at ``/`` and a live dashboard at ``/dashboard``, static files
inside the package (no CDN, works offline), and ``GET /stats``, the JSON the dashboard reads
every second. The pages hold no data: everything they show comes from the API with the key
the user types in (kept in the browser's local storage), so ``--api-key`` guards it all.
``--no-webui`` leaves the pages out (``/stats`` stays: it is part of the API)."""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenmill.api.errors import APIError
from tokenmill.server.state import ServerState

# The files the pages load, and their types; nothing else is served from the folder.
ASSETS = {"app.js": "text/javascript", "dashboard.js": "text/javascript",
          "common.js": "text/javascript", "style.css": "text/css"}
# The pages' own policy: scripts and styles from this server only, so model output that
# slipped into the page as HTML still could not run.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _read(name: str) -> str:
    return (resources.files("tokenmill.server") / "webui" / name).read_text(encoding="utf-8")


def stats(state: ServerState) -> dict[str, Any]:
    """Every served model's recent activity and drift scores."""
    models = {}
    for name, served in state.models.items():
        entry = {"task": served.task, **served.live.snapshot()}
        monitor = state.monitors.monitors.get(name) if state.monitors is not None else None
        entry["drift_scores"] = dict(monitor.scores) if monitor is not None else None
        entry["drift_threshold"] = (state.monitors.config.drift_threshold
                                    if state.monitors is not None else None)
        models[name] = entry
    return {"time": time.time(), "models": models}


def stats_router(state: ServerState, require_key: Any) -> APIRouter:
    """``GET /stats``, behind the API key like the inference routes."""
    router = APIRouter(dependencies=[Depends(require_key)])

    @router.get("/stats")
    async def live_stats() -> JSONResponse:
        return JSONResponse(stats(state))

    return router


def webui_router() -> APIRouter:
    """The pages and their files."""
    router = APIRouter(include_in_schema=False)
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache",
               "X-Content-Type-Options": "nosniff"}

    @router.get("/")
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(_read("index.html"), headers=headers)

    @router.get("/dashboard")
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(_read("dashboard.html"), headers=headers)

    @router.get("/ui/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"no such file: {name!r}")
        return Response(_read(name), media_type=ASSETS[name], headers=headers)

    return router
