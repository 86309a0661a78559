"""One Ray Serve replica: one served model's async engine (and its LoRA adapters) behind
``tokenmill serve``'s own application (``tokenmill.server.app.build_app``), answering the
requests the ingress forwards. Each served model is a deployment of such replicas.

The replica loads its engine as ``tokenmill serve`` does (``load_models``), on the CPUs or
GPU Ray gave its actor. Its engine publishes its KV-cache events (vLLM's format) on the
configured endpoints' ports + its rank (kv_endpoints.py), or with ``kv_events`` alone on a
free port of its node; the address is named in its routing stats for the prefix-aware router
(and open to any external KV-aware router). A request the ingress admitted for a project runs
as that project's (front.py); the LoRA adapters loaded while serving are applied from the
deployment's log before a request that needs them (adapters.py). Ray Serve calls ``check_health`` now and then: once an
engine has died the check fails and Ray replaces the replica. On shutdown Ray stops sending
requests and waits for the ones in flight (``graceful_shutdown_timeout_s``:
``--drain-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.args import LoRAModule
from tokenmill.serve_ray.adapters import AdapterSync, LogPosition
from tokenmill.serve_ray.front import ReplicaTenancy
from tokenmill.serve_ray.kv_endpoints import advertised, replica_endpoint
from tokenmill.serve_ray.messages import (
    INGRESS_DEPLOYMENT,
    HTTPRequestData,
    ModelInfo,
    ResponseHead,
    run_asgi,
)
from tokenmill.serve_ray.metrics import PUSH_INTERVAL_S, find_board
from tokenmill.serve_ray.routing import KV_EVENTS_STAT
from tokenmill.serve_ray.stores import remote_search
from tokenmill.server.app import build_app
from tokenmill.server.launcher import load_models
from tokenmill.server.lifecycle import ModelManager
from tokenmill.server.lora_adapters import load_lora_modules
from tokenmill.server.model_registry import config_factory
from tokenmill.server.state import GENERATE, ServerState
from tokenmill.tenancy.store import Caller

logger = logging.getLogger(__name__)


class ReplicaServer:
    """One served model's engine and the HTTP application over it. ``lora_modules``: the
    adapters this model serves (--lora-modules); ``kv_events``: publish KV-cache events."""

    def __init__(self, model: tuple[str | None, EngineConfig] | None, config: ServerConfig,
                 lora_modules: Sequence[LoRAModule] = (), kv_events: bool = False,
                 engine_args: argparse.Namespace | None = None) -> None:
        self.kv_events_endpoint: str | None = None
        context = serve.get_replica_context()
        # The admin API and project keys are the ingress's (front.py): the replica's own app
        # has no admin routes, and meters the requests the ingress admitted for a project.
        projects = config.admin_key is not None
        config = dataclasses.replace(config, admin_key=None)
        manager = None
        if model is None:  # --models-dir: none at start, each loaded when a request names it
            self.state = load_models([], config)
            factory = config_factory(engine_args or argparse.Namespace())
            manager = ModelManager(self.state, factory, config.models_dir,
                                   config.max_loaded_models, config.keep_alive, factory.budget)
        else:
            self.state = self._load(model, config, lora_modules, kv_events, _local_rank(context))
        # The file_search tool searches the ingress's vector stores (stores.py).
        ingress = functools.cache(lambda: serve.get_deployment_handle(
            INGRESS_DEPLOYMENT, context.app_name))
        self.app = build_app(self.state, manager, file_search=remote_search(ingress))
        self._tenancy = ReplicaTenancy(config, self.state.metrics.registry) if projects else None
        self._asgi = self._tenancy.wrap(self.app) if self._tenancy is not None else self.app
        self.name = context.replica_id.unique_id
        # LoRA adapters loaded or unloaded while serving (adapters.py), applied in order.
        self._adapters = AdapterSync(self.state, context.deployment)
        self._adapters_lock = asyncio.Lock()
        self._lifespan: contextlib.AbstractAsyncContextManager[None] | None = None
        self._start_lock = asyncio.Lock()
        self._pusher: asyncio.Future[None] | None = None

    def _load(self, model: tuple[str | None, EngineConfig], config: ServerConfig,
              lora_modules: Sequence[LoRAModule], kv_events: bool, rank: int) -> ServerState:
        """The model's engine (publishing its KV events with ``kv_events`` or on the
        endpoints configured, ``rank`` ports up: kv_endpoints.py) and adapters."""
        name, engine_config = model
        engine_config = self._kv_events_config(engine_config, kv_events, rank)
        state = load_models([(name, engine_config)], config)
        try:
            if lora_modules:
                # Ray Serve runs __init__ with an event loop running in this thread, and
                # load_lora_modules runs one of its own: on a thread of its own then.
                with ThreadPoolExecutor(1) as pool:
                    pool.submit(load_lora_modules, state, lora_modules).result()
        except BaseException:
            for served in state.models.values():
                served.client.engine.close()
            raise
        return state

    def _kv_events_config(self, config: EngineConfig, kv_events: bool, rank: int
                          ) -> EngineConfig:
        """``config`` with the endpoints this replica binds (none for a model without a
        prefix cache); ``kv_events_endpoint`` is set to where subscribers connect."""
        cache = config.cache
        if not _publishes(config):
            bind, replay = None, None
        elif cache.kv_events_endpoint is not None:
            bind = replica_endpoint(cache.kv_events_endpoint, rank)
            replay = (None if cache.kv_events_replay_endpoint is None else replica_endpoint(
                cache.kv_events_replay_endpoint, rank, "kv_events_replay_endpoint"))
        elif kv_events:
            bind, replay = _free_endpoint(), None
        else:
            return config
        if bind is not None:
            self.kv_events_endpoint = advertised(bind, _node_ip())
            logger.info("KV-cache events on %s (replay: %s)", bind, replay)
        cache = dataclasses.replace(cache, kv_events_endpoint=bind,
                                    kv_events_replay_endpoint=replay)
        return dataclasses.replace(config, cache=cache)

    async def _started(self) -> None:
        """Start the engines' step loops (the app's lifespan) on the replica's event loop,
        once, before the first request."""
        async with self._start_lock:
            if self._lifespan is None:
                lifespan = self.app.router.lifespan_context(self.app)
                await lifespan.__aenter__()
                self._lifespan = lifespan
                self._pusher = asyncio.ensure_future(self._push_metrics())

    async def _push_metrics(self) -> None:
        """Post this replica's exposition to the ingress's board now and then (metrics.py)."""
        while True:
            board = find_board()
            if board is not None:
                body, _ = self.state.metrics.render()
                board.put.remote(self.name, body.decode() if isinstance(body, bytes) else body)
            await asyncio.sleep(PUSH_INTERVAL_S)

    async def handle(self, request: HTTPRequestData, route_key: list[bytes] | None = None,
                     caller: Caller | None = None, adapters: LogPosition | None = None
                     ) -> AsyncIterator[ResponseHead | bytes]:
        """The response to ``request``: its head, then its body's chunks. ``route_key`` is
        the router's (the prompt's block hashes); the replica does not need it. ``caller``:
        the project the ingress admitted the request for; ``adapters``: how much of the
        deployment's adapter log the answer needs applied first (adapters.py)."""
        await self._started()
        await self._catch_up(adapters)
        context = (self._tenancy.context(caller)
                   if self._tenancy is not None and caller is not None else None)
        async for part in run_asgi(self._asgi, request, self.name, context):
            yield part

    async def _catch_up(self, adapters: LogPosition | None) -> None:
        if adapters is not None and self._adapters.behind(adapters):
            async with self._adapters_lock:
                await self._adapters.catch_up(adapters)

    async def describe(self, adapters: LogPosition | None = None) -> ModelInfo:
        """This deployment's model, for the ingress's routing table (its adapters as of the
        log's position ``adapters``)."""
        await self._catch_up(adapters)
        served = next(iter(self.state.models.values()))
        adapters = tuple(self.state.adapters_of(served.name))
        if served.task != GENERATE:
            return ModelInfo(served.name, served.task, adapters, served.client.tokenizer,
                             max_model_len=served.client.max_model_len)
        salts = {a: lora.cache_salt for a in adapters
                 if (lora := self.state.adapters[a].lora) is not None}
        return ModelInfo(served.name, served.task, adapters, served.client.tokenizer,
                         served.client.engine.config.cache.block_size, salts)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve hands these to the request router: where this replica's KV-cache events
        are published (routing.py subscribes)."""
        return {KV_EVENTS_STAT: self.kv_events_endpoint} if self.kv_events_endpoint else {}

    def replica_name(self) -> str:
        """The name this replica gives in the x-tokenmill-replica header."""
        return self.name

    async def check_health(self) -> None:
        """Raise (Ray then replaces this replica) once an engine has died. The first check
        starts the engines (and the metrics' posts) of a replica no request reached yet."""
        await self._started()
        if self.state.dead_reason is not None:
            raise RuntimeError(self.state.dead_reason)

    async def __del__(self) -> None:
        # Ray Serve awaits an async __del__ at shutdown, after requests in flight drained.
        # (Also called after a failed __init__: the attributes may be missing.)
        if getattr(self, "_pusher", None) is not None:
            self._pusher.cancel()
        if getattr(self, "_lifespan", None) is not None:
            with contextlib.suppress(Exception):
                await self._lifespan.__aexit__(None, None, None)


def _publishes(config: EngineConfig) -> bool:
    """Whether the engine can publish KV events: it keeps a prefix cache and pyzmq and
    msgpack import (tokenmill[ray])."""
    if config.model.task == "embed" or not config.cache.enable_prefix_caching:
        return False
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        return False
    return True


def _local_rank(context: Any) -> int:
    """The replica's rank among its deployment's replicas on this node (0, 1, ...)."""
    rank = getattr(context, "rank", None)
    return int(getattr(rank, "local_rank", rank) or 0)


def _node_ip() -> str:
    """This node's address (the one Ray knows it by)."""
    import ray

    return ray.util.get_node_ip_address()


def _free_endpoint() -> str:
    """A TCP endpoint on this node's address with a free port."""
    host = _node_ip()
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"
