"""Which replica answers a request: Ray Serve request routers (its ``RequestRouter``
interface, run inside the ingress's deployment handle).

``PrefixAwareRouter`` sends a request to the replica that already served the longest prefix
of its prompt's token blocks, as Ray Serve LLM's ``PrefixCacheAffinityRouter`` does (which
needs vLLM to import), but over the prefix cache's own block hashes (``hash_block`` of
tokenmill/core/kv_cache.py, computed by the ingress from the prompt's tokens): equal hashes
mean the replica holds (or held) those blocks. When the replicas' loads differ by more than
``imbalanced_threshold`` requests, or no replica matches, it falls back to the less loaded of
two (ties: the replica that holds fewer blocks, so unrelated prompts spread out).
``RoundRobinRouter`` takes the replicas in turn. pow2 is Ray Serve's default router.

Each router's table (kv_table.py) is fed by the replicas' own KV-cache events (each replica
names its endpoint in its routing stats) and by the router's guesses of what it just routed,
until the events confirm them: a wrong guess costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from tokenmill.core.kv_cache import BlockHash, hash_block
from tokenmill.serve_ray import ROUTERS
from tokenmill.serve_ray.kv_table import BlockTable, EventSubscriber

# The keyword argument of the replica call that carries the prompt's block hashes.
ROUTE_KEY = "route_key"
# The routing stat (a replica's record_routing_stats) naming its KV-events endpoint.
KV_EVENTS_STAT = "kv_events_endpoint"


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = 256,
                 salt: BlockHash | None = None) -> list[BlockHash]:
    """The prefix cache's hashes of the prompt's full blocks (at most ``max_blocks``): the
    same chain the replica's KV cache registers them under (``salt``: what the first block
    is chained to, a LoRA adapter's ``cache_salt``)."""
    hashes: list[BlockHash] = []
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        hashes.append(hash_block(hashes[-1] if hashes else salt,
                                 token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


def router_class(name: str) -> str | None:
    """The import path Ray Serve takes for ``--router NAME`` (None: its default, pow2)."""
    if name not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
    return {"prefix": f"{__name__}:PrefixAwareRouter",
            "round_robin": f"{__name__}:RoundRobinRouter"}.get(name)


def _route_key(pending: PendingRequest | None) -> list[BlockHash]:
    return list(pending.kwargs.get(ROUTE_KEY) or ()) if pending is not None else []


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """The replica with the longest cached prefix, unless the load is unbalanced; else the
    less loaded of two. One per deployment, hence one table per served model."""

    def initialize_state(self, imbalanced_threshold: int = 4,
                         max_blocks_per_replica: int = 100_000, guess_ttl_s: float = 10.0,
                         **_: Any) -> None:
        """Called by Ray Serve with the deployment's ``request_router_kwargs``."""
        self.imbalanced_threshold = imbalanced_threshold
        self.table = BlockTable(max_blocks_per_replica, guess_ttl_s)
        # Listens to the replicas' KV events (started with the first replica that has some).
        self._events: EventSubscriber | None = None

    def _load(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    def _listen(self, replicas: list[RunningReplica]) -> None:
        """Subscribe to the KV events of replicas that publish them (record_routing_stats)."""
        for replica in replicas:
            endpoint = (replica.routing_stats or {}).get(KV_EVENTS_STAT)
            if not endpoint:
                continue
            if self._events is None:
                self._events = EventSubscriber(self.table)
            self._events.add(replica.replica_id, endpoint)

    def _balanced_pick(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        two = random.sample(candidates, min(2, len(candidates)))
        return sorted(two, key=lambda r: (self._load(r), self.table.size(r.replica_id)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """Ranks of replicas, the most preferred first (Ray Serve probes them in turn)."""
        if not candidate_replicas:
            return []
        self._listen(candidate_replicas)
        hashes = _route_key(pending_request)
        loads = [self._load(r) for r in candidate_replicas]
        if hashes and max(loads) - min(loads) <= self.imbalanced_threshold:
            matched = {r.replica_id: self.table.matched(r.replica_id, hashes)
                       for r in candidate_replicas}
            best = max(candidate_replicas, key=lambda r: matched[r.replica_id])
            if matched[best.replica_id]:
                rest = [r for r in candidate_replicas if r is not best]
                return [[best], rest] if rest else [[best]]
        # No cached prefix anywhere (or an unbalanced load): the emptier of two, by queue
        # length, then by blocks held.
        ranked = self._balanced_pick(candidate_replicas)
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        """Guess that ``replica_id`` now holds the request's blocks (its events confirm)."""
        self.table.guess(replica_id, _route_key(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's blocks (its replacement starts empty)."""
        if self._events is not None:
            self._events.remove(replica_id)
        self.table.forget(replica_id)
        super().on_replica_actor_died(replica_id)


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Each replica in turn (ordered by id), the others as fallbacks when it is full."""

    def initialize_state(self, **_: Any) -> None:
        """Called by Ray Serve with the deployment's ``request_router_kwargs``."""
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """The next replica first, the rest after it."""
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        first = next(self._turn) % len(ordered)
        return [[ordered[first]], ordered[first + 1:] + ordered[:first]]
