"""The server's configuration and the state its routes share."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from tokenmill.api.protocol import now
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.metrics.prometheus import PrometheusStatLogger


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server behaves; the engine has its own EngineConfig.

    ``max_queue``: sequences that may wait beyond ``max_num_seqs`` running ones before new
    requests get 503. ``drain_timeout``: seconds SIGTERM waits for requests in flight before
    aborting them. ``auth_health_metrics``: also require the API key on /health and /metrics.
    ``debug_fail_at_step``: make the N-th engine step raise (fault-injection tests only).
    """

    # None: the model file's name without its extension (resolved by the launcher).
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 128
    max_body_bytes: int = 4 << 20
    drain_timeout: float = 30.0
    auth_health_metrics: bool = False
    debug_fail_at_step: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable auth)")


@dataclass
class ServerState:
    """What every route needs: the config, the engine client, the metrics."""

    config: ServerConfig
    client: AsyncLLM
    metrics: PrometheusStatLogger
    created: int = field(default_factory=now)
    # Set on SIGTERM: new requests get 503 while the ones in flight finish.
    draining: bool = False

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
        given = (authorization or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), key.encode())
