"""The request routers' choices, with made-up replicas and loads (no cluster), and the prefix
router's table fed by a replica's KV-cache events over ZeroMQ (vLLM's format)."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from tokenmill.core.kv_cache import KVCacheManager  # noqa: E402
from tokenmill.core.kv_events import BlockRemoved, BlockStored, ZmqEventPublisher  # noqa: E402
from tokenmill.serve_ray.kv_table import BlockTable  # noqa: E402
from tokenmill.serve_ray.routing import (  # noqa: E402
    KV_EVENTS_STAT,
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
    routing_stats: dict[str, Any] = field(default_factory=dict)


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


def test_an_adapters_block_hashes_are_salted_as_the_prefix_caches() -> None:
    tokens = list(range(50))
    kv = KVCacheManager(num_blocks=8, block_size=16)
    kv.set_salt("r", b"lora:1")
    assert block_hashes(tokens, 16, salt=b"lora:1") == kv.block_hashes("r", tokens, 3)
    assert block_hashes(tokens, 16, salt=b"lora:1") != block_hashes(tokens, 16)


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


def _stored(hashes: list[bytes]) -> BlockStored:
    return BlockStored(hashes, None, [0] * 16 * len(hashes), 16)


def test_events_teach_the_router_and_a_removal_unteaches_it() -> None:
    """A replica's BlockStored draws the prefix's requests to it (the router never sent it
    one); once its BlockRemoved says the blocks are gone, it no longer does."""
    router, (a, b) = _router(PrefixAwareRouter), _replicas(2)
    prefix = block_hashes(list(range(64)), 16)
    other = block_hashes([9] * 48, 16)
    router.table.apply(a.replica_id, [_stored(prefix), _stored(other)])
    assert _send(router, [a, b], prefix) is a
    assert _send(router, [b, a], prefix) is a
    router.table.apply(a.replica_id, [BlockRemoved(prefix)])
    # No replica holds it now: the one holding fewer blocks (b) is preferred.
    assert _send(router, [a, b], prefix) is b


def test_unconfirmed_guesses_lapse_for_a_replica_that_sends_events() -> None:
    now = [100.0]
    table = BlockTable(guess_ttl_s=10.0, clock=lambda: now[0])
    prefix = block_hashes(list(range(64)), 16)
    table.guess("a", prefix)
    table.guess("quiet", prefix)
    table.apply("a", [])  # "a" is heard from; "quiet" never is
    assert table.matched("a", prefix) == table.matched("quiet", prefix) == 4
    now[0] += 11
    assert table.matched("a", prefix) == 0  # no event confirmed the guess
    assert table.matched("quiet", prefix) == 4  # guesses are all there is
    table.apply("a", [_stored(prefix[:2])])
    table.guess("a", prefix[:2])  # a later guess does not demote what an event said
    now[0] += 100
    assert table.matched("a", prefix) == 2


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _run(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    cached = kv.find_cached_prefix(rid, tokens)
    assert kv.allocate_new(rid, cached, len(tokens), len(tokens)) is not None
    kv.register_computed(rid, tokens, len(tokens))
    kv.free(rid)
    kv.forget(rid)


def _until(check, publish) -> bool:
    """Publish and look again until ``check()`` holds (a SUB socket joins late: the first
    batches may be lost), for at most a minute."""
    for _ in range(600):
        publish()
        if check():
            return True
        time.sleep(0.1)
    return False


def test_router_follows_a_replicas_published_kv_events() -> None:
    """A replica's engine publishes its prefix cache's events on ZeroMQ; the router, told the
    endpoint by the replica's routing stats, subscribes: the replica that computed a prefix
    draws its requests, and after that replica evicts the prefix's blocks it no longer does."""
    endpoint = _free_endpoint()
    publisher = ZmqEventPublisher(endpoint)
    router = _router(PrefixAwareRouter)
    a, b = _replicas(2)
    a.routing_stats = {KV_EVENTS_STAT: endpoint}
    kv = KVCacheManager(num_blocks=6, block_size=16, enable_kv_events=True)
    prompt = list(range(64))
    prefix = block_hashes(prompt, 16)
    try:
        asyncio.run(router.choose_replicas([a, b], FakeRequest()))  # subscribes to a
        _run(kv, "p", prompt)
        stored = kv.take_events()
        # The first batches may reach no one: the same (idempotent) events again until heard.
        assert _until(lambda: router.table.matched(a.replica_id, prefix) == 4,
                      lambda: publisher.publish(stored))
        assert _send(router, [b, a], prefix) is a
        # Other prompts fill the 6 blocks: the prefix's blocks are handed out again.
        _run(kv, "q", [7] * 48)
        _run(kv, "r", [8] * 48)
        evicted = kv.take_events()
        assert any(isinstance(e, BlockRemoved) for e in evicted)
        assert _until(lambda: router.table.matched(a.replica_id, prefix) < 4,
                      lambda: publisher.publish(evicted))
        # Every block of the prompt is gone from a: a is not preferred for it any more (b,
        # which holds fewer blocks, is).
        assert router.table.matched(a.replica_id, prefix) == 0
        assert _send(router, [a, b], prefix) is b
    finally:
        if router._events is not None:
            router._events.close()
        publisher.close()
