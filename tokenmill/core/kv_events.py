"""KV-cache events in vLLM's wire format, for routers outside the process (NVIDIA Dynamo,
llm-d) that send a request where its prompt's blocks are already cached.

The block pool records an event whenever the prefix cache changes: a full block registered
under its hash (``BlockStored``), a registered block evicted (``BlockRemoved``), every hash
forgotten (``AllBlocksCleared``). The engine takes them once per step and a
``ZmqEventPublisher`` sends them as one ``EventBatch``: a ZeroMQ PUB message of three frames
(topic, an 8-byte big-endian sequence number, the msgpack payload), as vLLM's
``vllm/distributed/kv_events.py`` sends them. vLLM encodes its msgspec structs as arrays
(``array_like=True``), events tagged by their class name first and trailing fields equal to
their default left out (``omit_defaults=True``: only the batch's ``data_parallel_rank`` has
one; ``BlockStored``'s ``lora_id`` and ``medium`` are always written, null or not);
``encode_batch`` writes the same arrays with plain msgpack. Block hashes are the prefix
cache's own 16-byte hashes (see kv_cache.py); ``lora_id`` is the adapter's ``lora_int_id``.

With a replay endpoint the publisher also keeps the last ``buffer_steps`` batches and answers
vLLM's replay requests on a ZeroMQ ROUTER socket: a client that saw a gap in the sequence
numbers sends the first number it missed (8 bytes, big-endian) and receives every kept batch
from there as (sequence number, payload) frames, then the end marker (-1, empty payload).

Pure Python: pyzmq and msgpack (``pip install tokenmill[ray]``) are imported only by the
publisher and the encoder.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
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
                  token_ids: Sequence[int], block_size: int,
                  lora_id: int | None = None) -> list[KVCacheEvent]:
    """One ``BlockStored`` per run of consecutive newly registered blocks (``stored``: their
    indexes in the request's block list, ``hashes``: the request's block hashes, ``salt``: what
    its first block is chained to, ``lora_id``: the adapter the request ran with)."""
    runs: list[list[int]] = []
    for i in stored:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [BlockStored([hashes[i] for i in run], hashes[run[0] - 1] if run[0] else salt,
                        list(token_ids[run[0] * block_size:(run[-1] + 1) * block_size]),
                        block_size, lora_id)
            for run in runs]


def _event_array(event: KVCacheEvent) -> list[Any]:
    """An event as msgspec writes a tagged ``array_like`` struct: the tag, then every field
    (vLLM's event structs give their fields no defaults, so none is left out)."""
    if isinstance(event, BlockStored):
        fields = [event.block_hashes, event.parent_block_hash, event.token_ids,
                  event.block_size, event.lora_id, event.medium]
    elif isinstance(event, BlockRemoved):
        fields = [event.block_hashes, event.medium]
    else:
        fields = []
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


# The sequence number of the end-of-replay marker (vLLM's ``END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Batches kept for replay (vLLM's ``buffer_steps`` default).
BUFFER_STEPS = 10_000
# How long the replay thread waits for a request before it checks whether to stop (ms).
REPLAY_POLL_MS = 100


def _bind(socket: Any, endpoint: str, field: str) -> None:
    """Bind ``socket``; a ValueError naming ``field`` when the endpoint is taken or wrong."""
    import zmq

    try:
        socket.bind(endpoint)
    except zmq.ZMQError as e:
        socket.close(linger=0)
        raise ValueError(f"{field}: cannot bind {endpoint!r}: {e}") from None


class ZmqEventPublisher:
    """Publishes each step's events on a ZeroMQ PUB socket bound to ``endpoint`` (e.g.
    ``tcp://*:5557``), as vLLM's ``ZmqEventPublisher`` does: frames (topic, sequence number,
    payload). Subscribers that connect late miss earlier batches (PUB/SUB keeps nothing); with
    ``replay_endpoint`` (e.g. ``tcp://*:5558``) they ask for the last ``buffer_steps`` again
    (see the module's docstring)."""

    def __init__(self, endpoint: str, topic: str = "", data_parallel_rank: int | None = None,
                 replay_endpoint: str | None = None, buffer_steps: int = BUFFER_STEPS) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        _bind(self._socket, endpoint, "kv_events_endpoint")
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0
        # The engine's step thread publishes; close() may come from another thread.
        self._lock = threading.Lock()
        # The batches a replay may resend: (sequence number, payload), oldest first.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replay_thread: threading.Thread | None = None
        self._stop = threading.Event()
        if replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            try:
                _bind(replay, replay_endpoint, "kv_events_replay_endpoint")
            except ValueError:
                self.close()
                raise
            # The socket moves to the thread, which alone uses it from now on.
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(replay,),
                                                   name="kv-events-replay", daemon=True)
            self._replay_thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send ``events`` as one batch (nothing when there are none)."""
        if not events:
            return
        payload = encode_batch(EventBatch(time.time(), events, self._rank))
        with self._lock:
            if self._socket.closed:
                return
            self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
            if self._replay_thread is not None:
                self._buffer.append((self._seq, payload))
            self._seq += 1

    def replayed(self, start_seq: int) -> list[tuple[int, bytes]]:
        """The kept batches numbered ``start_seq`` or later, oldest first."""
        with self._lock:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]

    def _serve_replay(self, replay: Any) -> None:
        """Answer replay requests (frames: client id, empty, 8-byte start) until close()."""
        import zmq

        try:
            while not self._stop.is_set():
                if not replay.poll(REPLAY_POLL_MS):
                    continue
                frames = replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request: nothing to answer
                client = frames[0]
                for seq, payload in self.replayed(int.from_bytes(frames[2], "big")):
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                replay.send_multipart((client, b"", END_SEQ, b""))
        except zmq.ZMQError:  # the context was terminated
            pass
        finally:
            replay.close(linger=0)

    def close(self) -> None:
        """Close the sockets; later batches are dropped. Idempotent."""
        self._stop.set()
        with self._lock:
            if not self._socket.closed:
                # The port is free as soon as close() returns only if unbound first.
                with contextlib.suppress(Exception):
                    self._socket.unbind(self._socket.last_endpoint)
                self._socket.close(linger=0)
        if self._replay_thread is not None and self._replay_thread is not threading.current_thread():
            self._replay_thread.join(timeout=5)
