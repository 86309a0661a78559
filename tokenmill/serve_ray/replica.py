"""One Ray Serve replica: the served models' async engines behind ``tokenmill serve``'s own
application (``tokenmill.server.app.build_app``), answering the requests the ingress forwards.

The replica loads its engines as ``tokenmill serve`` does (``load_models``), on the CPUs or
GPU Ray gave its actor. Ray Serve calls ``check_health`` now and then: once an engine has
died the check fails and Ray replaces the replica. On shutdown Ray stops sending requests and
waits for the ones in flight (``graceful_shutdown_timeout_s``: ``--drain-timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from ray import serve

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.serve_ray.messages import HTTPRequestData, ResponseHead, run_asgi
from tokenmill.serve_ray.metrics import PUSH_INTERVAL_S, find_board
from tokenmill.server.app import build_app
from tokenmill.server.launcher import load_models
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class ReplicaServer:
    """The engines of every served model and the HTTP application over them."""

    def __init__(self, models: Sequence[tuple[str | None, EngineConfig]],
                 config: ServerConfig) -> None:
        self.state = load_models(list(models), config)
        self.app = build_app(self.state)
        self.name = serve.get_replica_context().replica_id.unique_id
        self._lifespan: contextlib.AbstractAsyncContextManager[None] | None = None
        self._start_lock = asyncio.Lock()
        self._pusher: asyncio.Future[None] | None = None

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

    async def handle(self, request: HTTPRequestData, route_key: list[bytes] | None = None
                     ) -> AsyncIterator[ResponseHead | bytes]:
        """The response to ``request``: its head, then its body's chunks. ``route_key`` is
        the router's (the prompt's block hashes); the replica does not need it."""
        await self._started()
        async for part in run_asgi(self.app, request, self.name):
            yield part

    def tokenizers(self) -> dict[str, tuple[Tokenizer, int]]:
        """Each generative model's tokenizer and KV block size, for the ingress's router."""
        return {name: (served.client.tokenizer, served.client.engine.config.cache.block_size)
                for name, served in self.state.models.items() if served.task == "generate"}

    def replica_name(self) -> str:
        """The name this replica gives in the x-tokenmill-replica header."""
        return self.name

    def check_health(self) -> None:
        """Raise (Ray then replaces this replica) once an engine has died."""
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
