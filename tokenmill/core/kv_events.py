"""KV-cache events in vLLM's wire format, for routers outside the process (NVIDIA Dynamo,
llm-d) that send a request where its prompt's blocks are already cached.

The block pool records an event whenever the prefix cache changes: a full block registered
under its hash (``BlockStored``), a registered block evicted (``BlockRemoved``), every hash
forgotten (``AllBlocksCleared``). The engine takes them once per step and a
``ZmqEventPublisher`` sends them as one ``EventBatch``: a ZeroMQ PUB message of three frames
(topic, an 8-byte big-endian sequence number, the msgpack payload), as vLLM's
``vllm/distributed/kv_events.py`` sends them. vLLM encodes its msgspec structs as arrays
(``array_like=True``), events tagged by their class name first and trailing fields equal to
their default left out (``omit_defaults=True``); ``encode_batch`` writes the same arrays with
plain msgpack. Block hashes are the prefix cache's own 16-byte hashes (see kv_cache.py).

Pure Python: pyzmq and msgpack (``pip install tokenmill[ray]``) are imported only by the
publisher and the encoder.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BlockHash = bytes

# The storage medium vLLM names for blocks in accelerator memory; tokenmill's KV blocks live in
# the device's memory (the GPU's, or the host's for a CPU engine).
MEDIUM = "GPU"


@dataclass(frozen=True)
class BlockStored:
    """Full blocks registered in the prefix cache, each chained to the one before."""

    block_hashes: list[BlockHash]
    # The hash the first block is chained to (None: it starts the prompt).
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


@dataclass(frozen=True)
class BlockRemoved:
    """Registered blocks whose hashes the cache forgot (the block was handed out again)."""

    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every registered hash forgotten at once (a prefix-cache reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """The events of one engine step, stamped with the time they were taken."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def stored_events(stored: list[int], hashes: list[BlockHash], salt: BlockHash | None,
                  token_ids: Sequence[int], block_size: int) -> list[KVCacheEvent]:
    """One ``BlockStored`` per run of consecutive newly registered blocks (``stored``: their
    indexes in the request's block list, ``hashes``: the request's block hashes, ``salt``: what
    its first block is chained to)."""
    runs: list[list[int]] = []
    for i in stored:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [BlockStored([hashes[i] for i in run], hashes[run[0] - 1] if run[0] else salt,
                        list(token_ids[run[0] * block_size:(run[-1] + 1) * block_size]),
                        block_size)
            for run in runs]


def _event_array(event: KVCacheEvent) -> list[Any]:
    """An event as msgspec writes a tagged ``array_like`` struct: the tag, then the fields,
    trailing defaults left out."""
    if isinstance(event, BlockStored):
        fields = [event.block_hashes, event.parent_block_hash, event.token_ids,
                  event.block_size, event.lora_id, event.medium]
        defaults = [None, MEDIUM]  # lora_id, medium
    elif isinstance(event, BlockRemoved):
        fields, defaults = [event.block_hashes, event.medium], [MEDIUM]
    else:
        fields, defaults = [], []
    while defaults and fields[-1] == defaults[-1]:
        fields.pop()
        defaults.pop()
    return [type(event).__name__, *fields]


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload vLLM's subscribers decode as a ``KVEventBatch``."""
    import msgpack

    body: list[Any] = [batch.ts, [_event_array(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """The inverse of ``encode_batch`` (for tests and for tools that read the stream);
    ValueError for an event it does not know."""
    import msgpack

    body = msgpack.unpackb(payload, raw=False)
    events: list[KVCacheEvent] = []
    for tag, *fields in body[1]:
        kind = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                "AllBlocksCleared": AllBlocksCleared}.get(tag)
        if kind is None:
            raise ValueError(f"unknown KV cache event {tag!r}")
        events.append(kind(*fields))
    return EventBatch(body[0], events, body[2] if len(body) > 2 else None)


class ZmqEventPublisher:
    """Publishes each step's events on a ZeroMQ PUB socket bound to ``endpoint`` (e.g.
    ``tcp://*:5557``), as vLLM's ``ZmqEventPublisher`` does: frames (topic, sequence number,
    payload). Subscribers that connect late miss earlier batches (PUB/SUB keeps nothing)."""

    def __init__(self, endpoint: str, topic: str = "", data_parallel_rank: int | None = None
                 ) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            raise ValueError(f"kv_events_endpoint: cannot bind {endpoint!r}: {e}") from None
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0
        # The engine's step thread publishes; close() may come from another thread.
        self._lock = threading.Lock()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send ``events`` as one batch (nothing when there are none)."""
        if not events:
            return
        payload = encode_batch(EventBatch(time.time(), events, self._rank))
        with self._lock:
            if self._socket.closed:
                return
            self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
            self._seq += 1

    def close(self) -> None:
        """Close the socket; later batches are dropped. Idempotent."""
        with self._lock:
            if not self._socket.closed:
                # The port is free as soon as close() returns only if unbound first.
                with contextlib.suppress(Exception):
                    self._socket.unbind(self._socket.last_endpoint)
                self._socket.close(linger=0)
