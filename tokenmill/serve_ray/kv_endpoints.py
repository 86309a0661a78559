"""Where each replica publishes its KV-cache events under ``--replicas``.

One endpoint cannot be bound by several processes, so ``--kv-events-endpoint tcp://HOST:PORT``
(and ``--kv-events-replay-endpoint``) name the first of a range: the replica of local rank
``r`` on its node (Ray Serve numbers a deployment's replicas on each node 0, 1, ...; a
replacement takes the rank of the replica it replaces) binds ``PORT + r``. External KV-aware
routers subscribe to ``PORT .. PORT + replicas - 1`` on every node; the prefix-aware router
learns each replica's address from its routing stats. Without the option a replica running
the prefix router publishes on a free port of its own.

Plain Python (no Ray): the ranges are checked before Ray starts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tokenmill.config import EngineConfig

_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/\[\]]+):(?P<port>\d+)$")
# Hosts that bind every interface: a subscriber needs the node's address instead.
_ANY_HOST = ("*", "0.0.0.0", "[::]")
FIELDS = ("kv_events_endpoint", "kv_events_replay_endpoint")


def _split(endpoint: str, field: str) -> tuple[str, int]:
    found = _TCP.match(endpoint)
    if found is None:
        raise ValueError(f"{field}: with --replicas each replica binds the port after the "
                         f"previous replica's, so the endpoint must be tcp://HOST:PORT, got "
                         f"{endpoint!r}")
    return found.group("host"), int(found.group("port"))


def replica_endpoint(endpoint: str, rank: int, field: str = "kv_events_endpoint") -> str:
    """The endpoint the replica of local rank ``rank`` binds: the port ``rank`` above."""
    host, port = _split(endpoint, field)
    if port + rank > 65535:
        raise ValueError(f"{field}: port {port} + replica rank {rank} is above 65535")
    return f"tcp://{host}:{port + rank}"


def advertised(endpoint: str, node_ip: str) -> str:
    """The address a subscriber on another process or node connects to (a wildcard host is
    the node's address)."""
    host, port = _split(endpoint, "kv_events_endpoint")
    return f"tcp://{node_ip}:{port}" if host in _ANY_HOST else endpoint


def port_ranges(models: Sequence[tuple[str | None, EngineConfig]], replicas: int
                ) -> list[tuple[int, int, str]]:
    """Each configured endpoint's range of ports (first, last, what it is), checked: a
    ValueError names the two that overlap (two deployments' replicas would bind one port)."""
    ranges: list[tuple[int, int, str]] = []
    for name, config in models:
        for field in FIELDS:
            endpoint = getattr(config.cache, field)
            if endpoint is None:
                continue
            _, port = _split(endpoint, field)
            if port + replicas - 1 > 65535:
                raise ValueError(f"{field}: ports {port} to {port + replicas - 1} (one per "
                                 "replica) go above 65535")
            what = f"{field} of {name or config.model.model or 'the default model'}"
            for first, last, other in ranges:
                if port <= last and first <= port + replicas - 1:
                    raise ValueError(
                        f"{what} ({port} to {port + replicas - 1}, one port per replica) "
                        f"overlaps the {other} ({first} to {last}); give each endpoint a "
                        f"port at least {replicas} apart")
            ranges.append((port, port + replicas - 1, what))
    return ranges
