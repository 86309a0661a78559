"""The server's configuration and the state its routes share."""

from __future__ import annotations

import asyncio
import functools
import hmac
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from tokenmill.api.protocol import now
from tokenmill.config import ServerConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.metrics.prometheus import PrometheusStatLogger

# "Bearer" (any case), one space, one credential of visible ASCII characters.
T = TypeVar("T")

# Threads that parse bodies, render chat templates and tokenize, so the event loop stays free
# for /health, /metrics and streaming while a large request is being prepared.
PREPARE_THREADS = 4

# credentials = "Bearer" 1*SP token: the scheme in any case, one credential of visible ASCII.
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +([\x21-\x7e]+)")


@dataclass
class ServerState:
    """What every route needs: the config, the engine client, the metrics."""

    config: ServerConfig
    client: AsyncLLM
    metrics: PrometheusStatLogger
    created: int = field(default_factory=now)
    # Set on SIGTERM: new requests get 503 while the ones in flight finish.
    draining: bool = False
    workers: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        PREPARE_THREADS, thread_name_prefix="tokenmill-prepare"))

    async def offload(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a worker thread: CPU work a request brings must not hold the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.workers, functools.partial(fn, *args))

    @property
    def model_name(self) -> str:
        """The name clients must use in ``model`` (or leave out)."""
        return self.config.served_model_name or "default"

    @property
    def serving(self) -> bool:
        """True while the server accepts inference requests."""
        dead = self.client.dead
        return not self.draining and dead is not None and not dead.is_set()

    def key_matches(self, authorization: str | None) -> bool:
        """Whether an ``Authorization: Bearer <key>`` header holds the API key (constant time)."""
        key = self.config.api_key
        if key is None:
            return True
        given = bearer_token(authorization)
        return given is not None and hmac.compare_digest(given.encode(), key.encode())


def bearer_token(authorization: str | None) -> str | None:
    """The credential of a ``Bearer`` Authorization header, read as RFC 6750 (2.1) and RFC 9110
    (11.4) say: the scheme is case-insensitive, then one or more spaces, then exactly one
    credential (no tab, no second word); None for any other header. (Whitespace around the
    whole value is not part of it: the HTTP parser has already dropped it.)"""
    match = _BEARER.fullmatch(authorization or "")
    return match.group(1) if match else None
