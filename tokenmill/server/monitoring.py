"""The drift monitors in the server: made per served model, fed prompt embeddings by the
embedding model when one is served, and shown by admin routes (behind ``--admin-key``, like
the rest of /admin).

``GET /admin/monitoring``: every served model's drift scores and the summaries of its reference
and live windows. ``GET /admin/monitoring/reference[?model=NAME]``: the live windows as a
reference profile, which ``tokenmill monitor save-reference`` stores for ``--monitor-reference``.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from tokenmill import sampling_params
from tokenmill.api.errors import APIError
from tokenmill.config import MonitorConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.monitoring.registry import EmbedFn, MonitorRegistry
from tokenmill.server.admin_routes import admin_key_check
from tokenmill.server.state import EMBED, ServerState

logger = logging.getLogger(__name__)


def make_monitors(config: MonitorConfig, metrics: PrometheusMetrics) -> MonitorRegistry | None:
    """The server's monitors (None when monitoring is off); reads the reference file now, so a
    bad one stops the server before any model loads (ValueError)."""
    if not config.enabled:
        return None
    return MonitorRegistry(config, metrics.drift_score)


def prompt_embedder(state: ServerState) -> EmbedFn | None:
    """Prompt embeddings from the first embedding model served (looked up at each call, so a
    swapped version is used); None when the engine cannot embed."""
    pooling = getattr(sampling_params, "PoolingParams", None)
    if pooling is None or not hasattr(AsyncLLM, "embed"):
        return None

    async def embed(texts: list[str]) -> list[list[float]]:
        served = state.model(None, task=EMBED)
        with served.lease():
            outputs = await served.client.embed(texts, pooling(truncate_prompt_tokens=-1))
        return [list(o.embedding) for o in outputs]

    return embed


def monitor_router(state: ServerState, monitors: MonitorRegistry) -> APIRouter:
    """The /admin/monitoring routes, behind the admin key."""
    router = APIRouter(prefix="/admin/monitoring",
                       dependencies=[Depends(admin_key_check(state))])

    @router.get("")
    async def monitoring() -> JSONResponse:
        # Scoring reads the windows under the monitors' locks: off the event loop.
        return JSONResponse(await state.offload(monitors.snapshot))

    @router.get("/reference")
    async def reference(model: str | None = None) -> JSONResponse:
        try:
            profile = await state.offload(monitors.window_profile, model)
        except ValueError as e:
            status = 404 if model is not None and model not in monitors.monitors else 409
            raise APIError(status, str(e), param="model" if status == 404 else None,
                           code="model_not_found" if status == 404 else "no_window") from None
        return JSONResponse(profile.as_dict())

    return router
