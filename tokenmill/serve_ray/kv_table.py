"""What the prefix-aware router knows of each replica's prefix cache: the block hashes it
holds, learnt from the replica's own KV-cache events (vLLM's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``, published over ZeroMQ by the replica's engine, see
tokenmill/core/kv_events.py) and, until an event confirms them, from the router's guesses.

A guess (the blocks of a request the router just sent to a replica) covers the time before
the replica has computed and stored them, so that a burst of requests sharing a prefix lands
on one replica. For a replica whose events the router hears, a guess no event confirmed
lapses after ``guess_ttl_s`` seconds, and a ``BlockRemoved`` removes the hash whatever the
router guessed: an evicted prefix stops drawing requests. A replica with no event stream (no
pyzmq, or the router is not subscribed yet) keeps its guesses (the oldest forgotten beyond
``max_blocks``).

``EventSubscriber`` is one thread with one SUB socket per replica (sockets stay in that
thread: ZeroMQ sockets are not thread-safe); it applies each batch to the table.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from tokenmill.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    decode_batch,
)

logger = logging.getLogger(__name__)

BlockHash = bytes
# How long the subscriber thread waits for a message before it looks for new sockets.
POLL_MS = 100


class BlockTable:
    """Per replica (any hashable id), the block hashes it holds. Thread-safe: the router
    reads it on its event loop, the subscriber writes it from its thread."""

    def __init__(self, max_blocks: int = 100_000, guess_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_blocks = max_blocks
        self.guess_ttl_s = guess_ttl_s
        self._clock = clock
        # hash -> None (an event said so) or the time of the router's guess.
        self._held: dict[Hashable, OrderedDict[BlockHash, float | None]] = {}
        # Replicas whose events the table receives: their guesses lapse.
        self._heard: set[Hashable] = set()
        self._lock = threading.Lock()

    def _blocks(self, replica: Hashable) -> OrderedDict[BlockHash, float | None]:
        return self._held.setdefault(replica, OrderedDict())

    def _trim(self, held: OrderedDict[BlockHash, float | None]) -> None:
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def guess(self, replica: Hashable, hashes: Sequence[BlockHash]) -> None:
        """The router sent a request with these blocks to ``replica``."""
        now = self._clock()
        with self._lock:
            held = self._blocks(replica)
            for h in hashes:
                if h not in held or held[h] is not None:  # an event's word stays
                    held[h] = now
                held.move_to_end(h)
            self._trim(held)

    def apply(self, replica: Hashable, events: Sequence[KVCacheEvent]) -> None:
        """What ``replica``'s prefix cache says changed."""
        with self._lock:
            self._heard.add(replica)
            held = self._blocks(replica)
            for event in events:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        held[bytes(h)] = None
                        held.move_to_end(bytes(h))
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        held.pop(bytes(h), None)
                elif isinstance(event, AllBlocksCleared):
                    held.clear()
            self._trim(held)

    def matched(self, replica: Hashable, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes`` (a prompt's chain), from the first, ``replica`` holds."""
        with self._lock:
            held = self._held.get(replica)
            if not held:
                return 0
            lapse = self._clock() - self.guess_ttl_s if replica in self._heard else None
            for i, h in enumerate(hashes):
                if h not in held:
                    return i
                stamp = held[h]
                if stamp is not None and lapse is not None and stamp < lapse:
                    return i
            return len(hashes)

    def size(self, replica: Hashable) -> int:
        """How many blocks ``replica`` holds (by the table)."""
        with self._lock:
            return len(self._held.get(replica, ()))

    def forget(self, replica: Hashable) -> None:
        """Drop a replica (it died: its replacement starts empty)."""
        with self._lock:
            self._held.pop(replica, None)
            self._heard.discard(replica)


class EventSubscriber:
    """Subscribes to replicas' KV-event endpoints (vLLM's ZeroMQ PUB format) and applies
    their batches to ``table``. ``add``/``remove`` may come from any thread."""

    def __init__(self, table: BlockTable) -> None:
        self.table = table
        self._changes: queue.SimpleQueue[tuple[Hashable, str | None]] = queue.SimpleQueue()
        self._endpoints: dict[Hashable, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def add(self, replica: Hashable, endpoint: str) -> None:
        """Listen to ``replica``'s events at ``endpoint`` (a no-op when already)."""
        if self._endpoints.get(replica) != endpoint:
            self._endpoints[replica] = endpoint
            self._changes.put((replica, endpoint))

    def remove(self, replica: Hashable) -> None:
        """Stop listening to ``replica``."""
        if self._endpoints.pop(replica, None) is not None:
            self._changes.put((replica, None))

    def close(self) -> None:
        """Stop the thread and close its sockets."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        poller = zmq.Poller()
        sockets: dict[Hashable, zmq.Socket] = {}
        owner: dict[zmq.Socket, Hashable] = {}
        try:
            while not self._stop.is_set():
                while not self._changes.empty():
                    replica, endpoint = self._changes.get()
                    old = sockets.pop(replica, None)
                    if old is not None:
                        poller.unregister(old)
                        owner.pop(old, None)
                        old.close(linger=0)
                    if endpoint is not None:
                        sock = ctx.socket(zmq.SUB)
                        sock.setsockopt(zmq.SUBSCRIBE, b"")
                        sock.connect(endpoint)
                        sockets[replica] = sock
                        owner[sock] = replica
                        poller.register(sock, zmq.POLLIN)
                for sock, _ in poller.poll(POLL_MS) if sockets else []:
                    self._receive(owner[sock], sock)
                if not sockets:
                    self._stop.wait(POLL_MS / 1000)
        finally:
            for sock in sockets.values():
                sock.close(linger=0)

    def _receive(self, replica: Hashable, sock: object) -> None:
        import zmq

        with contextlib.suppress(zmq.Again):
            while True:
                frames = sock.recv_multipart(zmq.NOBLOCK)  # type: ignore[attr-defined]
                try:
                    batch = decode_batch(frames[-1])
                except (ValueError, TypeError) as e:  # a publisher of another format
                    logger.warning("KV events of %s: undecodable batch: %s", replica, e)
                    continue
                self.table.apply(replica, batch.events)
