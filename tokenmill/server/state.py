"""The server's configuration and the state its routes share."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from tokenmill.api.protocol import now
from tokenmill.config import ServerConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.metrics.prometheus import PrometheusStatLogger


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
