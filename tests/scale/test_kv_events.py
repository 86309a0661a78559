"""KV-cache events in vLLM's format: the block pool records them, a ZeroMQ subscriber receives
them as vLLM's ``KVEventBatch`` arrays, and replaying them rebuilds the prefix cache's hashes."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq

from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
)

BS = 4


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _run(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """A request computes all of ``tokens`` and finishes."""
    cached = kv.find_cached_prefix(rid, tokens)
    blocks = kv.allocate_new(rid, cached, len(tokens), len(tokens))
    assert blocks is not None
    kv.register_computed(rid, tokens, len(tokens))
    kv.free(rid)
    kv.forget(rid)
    return blocks


def _replay(events: list, cached: set[bytes]) -> None:
    for e in events:
        if isinstance(e, BlockStored):
            cached.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            cached.difference_update(e.block_hashes)
        else:
            cached.clear()


def test_events_follow_the_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_kv_events=True)
    prompt = list(range(1, 10))  # two full blocks and one token
    _run(kv, "a", prompt)
    events = kv.take_events()
    hashes = kv.block_hashes("x", prompt, 2)
    assert events == [BlockStored(hashes, None, prompt[:8], BS)]
    assert kv.take_events() == []  # taken once
    # A hit registers nothing new; a longer prompt stores only its new block, chained.
    _run(kv, "b", prompt + [10, 11, 12, 13])
    longer = kv.block_hashes("y", prompt + [10, 11, 12, 13], 3)
    assert kv.take_events() == [BlockStored([longer[2]], longer[1], [9, 10, 11, 12], BS)]
    # Unrelated prompts fill the pool: the oldest registered blocks are evicted.
    cached: set[bytes] = set(longer)
    for i in range(3):
        _run(kv, f"c{i}", [100 + 10 * i + j for j in range(9)])
    events = kv.take_events()
    assert any(isinstance(e, BlockRemoved) for e in events)
    _replay(events, cached)
    assert cached == set(kv.pool._cached)
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_events_off_by_default() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    _run(kv, "a", list(range(1, 10)))
    assert kv.pool.events is None and kv.take_events() == []


def test_wire_format_is_vllms_arrays() -> None:
    """msgspec's array_like tagged structs: [ts, [[tag, fields...], ...]], trailing defaults
    left out (what vLLM's KVEventBatch decoder reads)."""
    h1, h2 = b"\x01" * 16, b"\x02" * 16
    batch = EventBatch(12.5, [BlockStored([h1, h2], None, [1, 2, 3, 4], 2),
                              BlockStored([h2], h1, [5, 6], 2, lora_id=3),
                              BlockRemoved([h1]), AllBlocksCleared()])
    raw = msgpack.unpackb(encode_batch(batch))
    assert raw == [12.5, [["BlockStored", [h1, h2], None, [1, 2, 3, 4], 2],
                          ["BlockStored", [h2], h1, [5, 6], 2, 3],
                          ["BlockRemoved", [h1]], ["AllBlocksCleared"]]]
    assert decode_batch(encode_batch(batch)) == batch
    ranked = EventBatch(1.0, [], data_parallel_rank=1)
    assert msgpack.unpackb(encode_batch(ranked)) == [1.0, [], 1]


def _subscribe(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(endpoint)
    return sub


def _handshake(pub: ZmqEventPublisher, sub: zmq.Socket) -> None:
    """PUB drops what it sends before a subscriber has joined: send a (harmless, the cache is
    empty) clear until one arrives."""
    for _ in range(100):
        pub.publish([AllBlocksCleared()])
        try:
            sub.recv_multipart()
            return
        except zmq.Again:
            time.sleep(0.05)
    raise AssertionError("the subscriber never received a batch")


def _receive(sub: zmq.Socket, until: set[bytes], cached: set[bytes]) -> list[int]:
    seqs = []
    for _ in range(200):
        if cached == until:
            break
        try:
            topic, seq, payload = sub.recv_multipart()
        except zmq.Again:
            continue
        assert topic == b""
        seqs.append(int.from_bytes(seq, "big"))
        _replay(decode_batch(payload).events, cached)
    return seqs


def test_subscriber_sees_the_engines_prefix_cache() -> None:
    """An engine with --kv-events-endpoint: a subscriber that replays the batches it
    receives holds the engine's registered hashes, in sequence."""
    from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    endpoint = _free_endpoint()
    engine = LLMEngine(EngineConfig(
        cache=CacheConfig(num_blocks=24, block_size=16, kv_events_endpoint=endpoint),
        scheduler=SchedulerConfig(max_num_seqs=4)))
    sub = _subscribe(endpoint)
    try:
        _handshake(engine.core.kv_events, sub)
        params = SamplingParams(max_tokens=4, temperature=0.0)
        system = "You are a terse assistant. " * 8
        for i, prompt in enumerate([system + "Hello", system + "Bye", "Unrelated words " * 20]):
            engine.add_request(str(i), prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
        pool = engine.core.scheduler.kv.pool
        assert pool.num_cached_blocks > 2
        cached: set[bytes] = set()
        seqs = _receive(sub, set(pool._cached), cached)
        assert cached == set(pool._cached)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    finally:
        sub.close(linger=0)
        engine.close()
    # The socket is closed with the engine: the endpoint can be bound again (ZeroMQ lets
    # the port go in its I/O thread, a moment later).
    for _ in range(50):
        try:
            ZmqEventPublisher(endpoint).close()
            break
        except ValueError:
            time.sleep(0.1)
    else:
        raise AssertionError(f"{endpoint} still bound after the engine closed")


def test_endpoint_in_use_names_the_field() -> None:
    endpoint = _free_endpoint()
    first = ZmqEventPublisher(endpoint)
    try:
        with pytest.raises(ValueError, match="kv_events_endpoint"):
            ZmqEventPublisher(endpoint)
    finally:
        first.close()


def test_an_encoder_publishes_nothing_and_binds_nothing() -> None:
    """`tokenmill serve --kv-events-endpoint` with the embedded models: the embedding model has
    no KV cache, so it leaves the endpoint to the chat model."""
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
    from tokenmill.engine.llm_engine import LLMEngine

    endpoint = _free_endpoint()
    engine = LLMEngine(EngineConfig(model=ModelConfig(task="embed"),
                                    cache=CacheConfig(kv_events_endpoint=endpoint)))
    try:
        assert engine.core.kv_events is None
        ZmqEventPublisher(endpoint).close()
    finally:
        engine.close()


def test_the_option_reaches_the_cache_config() -> None:
    import argparse

    from tokenmill.engine.args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--kv-events-endpoint", "tcp://*:5557"])
    assert engine_config_from_args(args).cache.kv_events_endpoint == "tcp://*:5557"
    assert engine_config_from_args(p.parse_args([])).cache.kv_events_endpoint is None
