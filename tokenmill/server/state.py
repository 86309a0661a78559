"""The server's configuration and the state its routes share."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import itertools
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from tokenmill.api.errors import APIError
from tokenmill.api.protocol import now
from tokenmill.config import ServerConfig
from tokenmill.engine.async_llm import AsyncLLM, StepLoop
from tokenmill.lora_request import LoRARequest
from tokenmill.metrics.live import LiveStats
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.monitoring.registry import MonitorRegistry

# "Bearer" (any case), one space, one credential of visible ASCII characters.
T = TypeVar("T")

# Threads that parse bodies, render chat templates and tokenize, so the event loop stays free
# for /health, /metrics and streaming while a large request is being prepared.
PREPARE_THREADS = 4

# credentials = "Bearer" 1*SP token: the scheme in any case, one credential of visible ASCII.
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +([\x21-\x7e]+)")


# What a served model does: "generate" (chat, completions, classify) or "embed".
GENERATE, EMBED = "generate", "embed"


@dataclass
class ServedModel:
    """One model the server serves: the name clients send as ``model``, its engine client.

    ``leases`` counts the requests that resolved this model and have not yet been queued in
    its engine: a drain (unload, swap) waits for them too.

    A LoRA adapter is served as a model of its own: ``lora`` is the adapter its requests run
    with and ``base`` the served model whose engine (``client``) runs them."""

    name: str
    client: AsyncLLM
    task: str = GENERATE
    path: str = ""
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    loaded_at: float = field(default_factory=time.time)
    leases: int = 0
    # Loaded on demand (not named on the command line): --keep-alive and --max-loaded-models
    # may unload it when it is idle.
    on_demand: bool = False
    last_used: float = field(default_factory=time.monotonic)
    # Its recent activity, for the dashboard (fed by its engine's steps).
    live: LiveStats = field(default_factory=LiveStats)
    lora: LoRARequest | None = None
    base: ServedModel | None = None

    @contextlib.contextmanager
    def lease(self) -> Iterator[ServedModel]:
        """Hold the model (and an adapter's base, whose engine the request reaches) while a
        request is prepared and submitted."""
        held = [self] if self.base is None else [self, self.base]
        for served in held:
            served.leases += 1
            served.last_used = time.monotonic()
        try:
            yield self
        finally:
            for served in held:
                served.leases -= 1
                served.last_used = time.monotonic()

    @property
    def idle(self) -> bool:
        """No request holds it or runs in it."""
        return not self.leases and not self.client.num_seqs_in_flight


@dataclass
class ServerState:
    """What every route needs: the config, the served models (first: the default of its
    task), the metrics of them all."""

    config: ServerConfig
    # One entry per engine: what starts, stops, drains and reports.
    models: dict[str, ServedModel]
    metrics: PrometheusMetrics
    # LoRA adapters by name (tokenmill/server/lora_adapters.py): entries that share their
    # base's engine, kept apart from ``models`` so nothing counts an engine twice.
    adapters: dict[str, ServedModel] = field(default_factory=dict)
    # Each adapter loaded gets the next id: its weights' key in the engine.
    lora_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    # The one thread that steps every model's engine (see StepLoop).
    step_loop: StepLoop = field(default_factory=StepLoop)
    # The drift monitor of every served generative model; None: monitoring is off.
    monitors: MonitorRegistry | None = None
    # Loads a model a request names that is not loaded (--models-dir); None: no such loading.
    load_on_demand: Callable[[str], Awaitable[ServedModel | None]] | None = None
    created: int = field(default_factory=now)
    # Set on SIGTERM: new requests get 503 while the ones in flight finish.
    draining: bool = False
    workers: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        PREPARE_THREADS, thread_name_prefix="tokenmill-prepare"))

    async def offload(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a worker thread: CPU work a request brings must not hold the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.workers, functools.partial(fn, *args))

    async def resolve(self, requested: str | None,
                      task: str | None = GENERATE) -> ServedModel:
        """``model()``, loading a model that is not loaded first when the server loads on
        demand (a name it cannot load stays a 404)."""
        if (requested is not None and not self.serves(requested)
                and self.load_on_demand is not None):
            served = await self.load_on_demand(requested)
            if served is not None:
                # The name may be another spelling of a loaded file (./x.gguf, its full path).
                requested = served.name
        return self.model(requested, task)

    def model(self, requested: str | None, task: str | None = GENERATE) -> ServedModel:
        """The model a request names (None: the first one serving ``task``): 404 for a name
        no model has, 400 for a model of another task (``task`` None: any)."""
        if requested is None:
            for served in self.models.values():
                if task is None or served.task == task:
                    return served
            what = ("no embedding model: it does not serve embeddings" if task == EMBED else
                    "no text-generation model: its models compute embeddings "
                    "(POST /v1/embeddings)")
            raise APIError(400, f"this server serves {what}", param="model",
                           code="wrong_model_type")
        served = self.models.get(requested) or self.adapters.get(requested)
        if served is None:
            raise unknown_model(requested, [*self.models, *self.adapters])
        if task is not None and served.task != task:
            if served.base is not None:
                what = (f"is a LoRA adapter of {served.base.name!r}: adapters apply to text "
                        "generation, not embeddings")
            elif served.task == EMBED:
                what = "computes embeddings (POST /v1/embeddings); it does not generate text"
            else:
                what = "generates text; it does not serve embeddings"
            raise APIError(400, f"the model {requested!r} {what}", param="model",
                           code="wrong_model_type")
        return served

    def serves(self, name: str) -> bool:
        """Whether ``name`` is a loaded model or adapter."""
        return name in self.models or name in self.adapters

    def adapters_of(self, base: str) -> list[str]:
        """The names of the adapters that run on the model ``base``."""
        return [a.name for a in self.adapters.values()
                if a.base is not None and a.base.name == base]

    @property
    def clients(self) -> list[AsyncLLM]:
        return [m.client for m in self.models.values()]

    @property
    def dead_reason(self) -> str | None:
        """Why a model's engine died (the first such), None while all run."""
        return next((c.dead_reason for c in self.clients if c.dead_reason), None)

    @property
    def serving(self) -> bool:
        """True while the server accepts inference requests (every engine running)."""
        return not self.draining and all(
            c.dead is not None and not c.dead.is_set() for c in self.clients)

    def key_matches(self, authorization: str | None) -> bool:
        """Whether an ``Authorization: Bearer <key>`` header holds the API key (constant time)."""
        key = self.config.api_key
        if key is None:
            return True
        given = bearer_token(authorization)
        return given is not None and hmac.compare_digest(given.encode(), key.encode())


def unknown_model(requested: str, names: list[str]) -> APIError:
    """The 404 for a model name no served model or adapter has (``names``: those served);
    shared with the Ray Serve ingress, which routes by the name."""
    return APIError(404, f"the model {requested!r} does not exist; this server serves "
                    f"{', '.join(repr(n) for n in names)}", param="model",
                    code="model_not_found")


def bearer_token(authorization: str | None) -> str | None:
    """The credential of a ``Bearer`` Authorization header, read as RFC 6750 (2.1) and RFC 9110
    (11.4) say: the scheme is case-insensitive, then one or more spaces, then exactly one
    credential (no tab, no second word); None for any other header. (Whitespace around the
    whole value is not part of it: the HTTP parser has already dropped it.)"""
    match = _BEARER.fullmatch(authorization or "")
    return match.group(1) if match else None
