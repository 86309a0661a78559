"""The web page: a chat playground at ``/`` and a live dashboard at ``/dashboard``, static files
inside the package (no CDN, works offline), ``GET /stats``, the JSON the dashboard reads every
second, and ``GET /stats/history``, the last minutes of the numbers its charts plot (sampled
every second on the server, so a new tab starts with full charts). The pages hold no data:
everything they show comes from the API with the key the user types in (kept in the browser's
local storage), so ``--api-key`` guards it all. ``--no-webui`` leaves the pages out (the
``/stats`` routes stay: they are part of the API)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenmill.api.errors import APIError
from tokenmill.server.state import ServedModel, ServerState

logger = logging.getLogger(__name__)

# The files the pages load, and their types; nothing else is served from the folder.
ASSETS = {"app.js": "text/javascript", "dashboard.js": "text/javascript",
          "common.js": "text/javascript", "markdown.js": "text/javascript",
          "projects.js": "text/javascript",
          "style.css": "text/css"}
# The pages' own policy: scripts and styles from this server only, so model output that
# slipped into the page as HTML still could not run.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _read(name: str) -> str:
    return (resources.files("tokenmill.server") / "webui" / name).read_text(encoding="utf-8")


# The charts' history: one sample a second, the last five minutes.
SAMPLE_INTERVAL_S = 1.0
HISTORY_SAMPLES = 300
# The numbers of a model's /stats entry that the dashboard's charts plot.
CHART_FIELDS = ("output_tokens_per_s", "prompt_tokens_per_s", "running", "waiting",
                "kv_cache_usage", "ttft_seconds", "itl_seconds")


class StatsHistory:
    """A ring buffer of the charts' numbers: the newest ``max_samples`` samples, each the time
    and every served model's CHART_FIELDS (a model loaded later has fewer samples)."""

    def __init__(self, max_samples: int = HISTORY_SAMPLES,
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.interval_s = interval_s
        self._samples: deque[tuple[float, dict[str, dict[str, Any]]]] = deque(
            maxlen=max_samples)

    def add(self, now: float, snapshots: dict[str, dict[str, Any]]) -> None:
        """Keep one sample: ``snapshots`` maps model names to their /stats entries."""
        self._samples.append((now, {name: {k: entry[k] for k in CHART_FIELDS}
                                    for name, entry in snapshots.items()}))

    def as_json(self) -> dict[str, Any]:
        """``{"interval_s", "models": {name: [{"time", **CHART_FIELDS}, ...]}}``, oldest first."""
        models: dict[str, list[dict[str, Any]]] = {}
        for now, snapshots in self._samples:
            for name, fields in snapshots.items():
                models.setdefault(name, []).append({"time": now, **fields})
        return {"interval_s": self.interval_s, "models": models}

    def sample(self, state: ServerState) -> None:
        """Add the served models' numbers now."""
        self.add(time.time(), {name: served.live.snapshot()
                               for name, served in state.models.items()})


def _priced(served: ServedModel) -> bool:
    # Without --cost-per-hour every cost is 0: say "no price", not "$0".
    return served.client.engine.config.economics.cost_per_hour > 0


def stats(state: ServerState) -> dict[str, Any]:
    """Every served model's recent activity and drift scores, and whether the API wants a key
    (the pages show their key button only then)."""
    models = {}
    for name, served in state.models.items():
        entry = {"task": served.task, **served.live.snapshot()}
        if not _priced(served):
            entry["usd_per_1k_output_tokens"] = None
        monitor = state.monitors.monitors.get(name) if state.monitors is not None else None
        entry["drift_scores"] = dict(monitor.scores) if monitor is not None else None
        entry["drift_threshold"] = (state.monitors.config.drift_threshold
                                    if state.monitors is not None else None)
        models[name] = entry
    return {"time": time.time(), "api_key_required": state.config.api_key is not None,
            "models": models}


async def _keep_sampling(state: ServerState, history: StatsHistory) -> None:
    while True:
        try:
            history.sample(state)
        except Exception:  # one bad sample must not end the charts' history
            logger.exception("cannot sample the dashboard's stats")
        await asyncio.sleep(history.interval_s)


def stats_router(state: ServerState, require_key: Any,
                 history: StatsHistory | None = None) -> APIRouter:
    """``GET /stats`` and ``GET /stats/history``, behind the API key like the inference routes;
    the router's lifespan samples ``history`` every second while the server runs."""
    history = history if history is not None else StatsHistory()

    @contextlib.asynccontextmanager
    async def sampling(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_keep_sampling(state, history))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    router = APIRouter(dependencies=[Depends(require_key)], lifespan=sampling)

    @router.get("/stats")
    async def live_stats() -> JSONResponse:
        return JSONResponse(stats(state))

    @router.get("/stats/history")
    async def stats_history() -> JSONResponse:
        return JSONResponse(history.as_json())

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
