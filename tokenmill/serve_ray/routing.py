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

Each router's table of blocks is approximate (it records what it routed, as Ray's router
does, and forgets the oldest blocks beyond ``max_blocks_per_replica``): a wrong guess costs
a cache miss, never a wrong answer.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
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

# The keyword argument of the replica call that carries the prompt's block hashes.
ROUTE_KEY = "route_key"


def block_hashes(token_ids: Sequence[int], block_size: int,
                 max_blocks: int = 256) -> list[BlockHash]:
    """The prefix cache's hashes of the prompt's full blocks (at most ``max_blocks``): the
    same chain the replica's KV cache registers them under."""
    hashes: list[BlockHash] = []
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        hashes.append(hash_block(hashes[-1] if hashes else None,
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
    less loaded of two."""

    def initialize_state(self, imbalanced_threshold: int = 4,
                         max_blocks_per_replica: int = 100_000, **_: Any) -> None:
        """Called by Ray Serve with the deployment's ``request_router_kwargs``."""
        self.imbalanced_threshold = imbalanced_threshold
        self.max_blocks = max_blocks_per_replica
        self._blocks: dict[ReplicaID, OrderedDict[BlockHash, None]] = {}

    def _load(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    def _held(self, replica: RunningReplica) -> OrderedDict[BlockHash, None]:
        return self._blocks.setdefault(replica.replica_id, OrderedDict())

    def _matched(self, replica: RunningReplica, hashes: list[BlockHash]) -> int:
        held = self._held(replica)
        return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))

    def _balanced_pick(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        two = random.sample(candidates, min(2, len(candidates)))
        return sorted(two, key=lambda r: (self._load(r), len(self._held(r))))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """Ranks of replicas, the most preferred first (Ray Serve probes them in turn)."""
        if not candidate_replicas:
            return []
        hashes = _route_key(pending_request)
        loads = [self._load(r) for r in candidate_replicas]
        if hashes and max(loads) - min(loads) <= self.imbalanced_threshold:
            best = max(candidate_replicas, key=lambda r: self._matched(r, hashes))
            if self._matched(best, hashes):
                rest = [r for r in candidate_replicas if r is not best]
                return [[best], rest] if rest else [[best]]
        # No cached prefix anywhere (or an unbalanced load): the emptier of two, by queue
        # length, then by blocks held.
        ranked = self._balanced_pick(candidate_replicas)
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        """Record that ``replica_id`` now holds the request's blocks."""
        held = self._blocks.setdefault(replica_id, OrderedDict())
        for h in _route_key(pending_request):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's blocks (its replacement starts empty)."""
        self._blocks.pop(replica_id, None)
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
