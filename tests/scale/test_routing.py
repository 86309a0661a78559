"""The request routers' choices, with made-up replicas and loads (no cluster)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from tokenmill.core.kv_cache import KVCacheManager  # noqa: E402
from tokenmill.serve_ray.routing import (  # noqa: E402
    ROUTE_KEY,
    PrefixAwareRouter,
    RoundRobinRouter,
    block_hashes,
    router_class,
)

DEPLOYMENT = DeploymentID(name="tokenmill-replica", app_name="tokenmill")


@dataclass
class FakeReplica:
    replica_id: ReplicaID


@dataclass
class FakeRequest:
    kwargs: dict[str, Any] = field(default_factory=dict)


def _replicas(n: int) -> list[FakeReplica]:
    return [FakeReplica(ReplicaID(f"r{i}", DEPLOYMENT)) for i in range(n)]


def _router(cls: type, **kwargs: Any) -> Any:
    router = cls(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    return router


def _send(router: Any, replicas: list[FakeReplica], hashes: list[bytes]) -> FakeReplica:
    """Route one request as Ray Serve does: the first replica of the first rank."""
    request = FakeRequest({ROUTE_KEY: hashes})
    chosen = asyncio.run(router.choose_replicas(replicas, request))[0][0]
    router.on_request_routed(request, chosen.replica_id, None)
    return chosen


def test_block_hashes_are_the_prefix_caches() -> None:
    tokens = list(range(50))
    kv = KVCacheManager(num_blocks=8, block_size=16)
    assert block_hashes(tokens, 16) == kv.block_hashes("r", tokens, 3)
    assert block_hashes(tokens, 16, max_blocks=2) == kv.block_hashes("r", tokens, 2)


def test_prefix_follows_the_cached_blocks() -> None:
    router, replicas = _router(PrefixAwareRouter), _replicas(3)
    shared = block_hashes(list(range(64)), 16)
    first = _send(router, replicas, shared)
    # Longer prompts with the same start go where it is cached.
    for tail in range(3):
        longer = block_hashes(list(range(64)) + [1000 + tail] * 16, 16)
        assert _send(router, replicas, longer) is first
    # A prompt sharing nothing goes to a replica holding fewer blocks.
    other = _send(router, replicas, block_hashes([7] * 64, 16))
    assert other is not first


def test_prefix_balances_an_unbalanced_load() -> None:
    router, replicas = _router(PrefixAwareRouter, imbalanced_threshold=2), _replicas(2)
    shared = block_hashes(list(range(64)), 16)
    first = _send(router, replicas, shared)
    router._replica_queue_len_cache.update(first.replica_id, 5)
    router._replica_queue_len_cache.update(
        next(r for r in replicas if r is not first).replica_id, 0)
    assert _send(router, replicas, shared) is not first


def test_round_robin_takes_turns() -> None:
    router, replicas = _router(RoundRobinRouter), _replicas(3)
    chosen = [_send(router, replicas, []).replica_id.unique_id for _ in range(6)]
    assert chosen == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_unknown_router_names_the_choices() -> None:
    assert router_class("pow2") is None
    with pytest.raises(ValueError, match="prefix, pow2, round_robin"):
        router_class("random")
