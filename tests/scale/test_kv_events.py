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
    """msgspec's array_like tagged structs: [ts, [[tag, fields...], ...]]. vLLM's BlockStored
    and BlockRemoved give no field a default (lora_id and medium are Optional, not omitted):
    every field is written, or vLLM's KVEventBatch decoder refuses the array as too short."""
    h1, h2 = b"\x01" * 16, b"\x02" * 16
    batch = EventBatch(12.5, [BlockStored([h1, h2], None, [1, 2, 3, 4], 2),
                              BlockStored([h2], h1, [5, 6], 2, lora_id=3),
                              BlockRemoved([h1]), AllBlocksCleared()])
    raw = msgpack.unpackb(encode_batch(batch))
    assert raw == [12.5, [["BlockStored", [h1, h2], None, [1, 2, 3, 4], 2, None, "GPU"],
                          ["BlockStored", [h2], h1, [5, 6], 2, 3, "GPU"],
                          ["BlockRemoved", [h1], "GPU"], ["AllBlocksCleared"]]]
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


def test_stored_blocks_name_their_adapter() -> None:
    """A request run with an adapter: its BlockStored carries the adapter's lora_int_id (as
    vLLM's lora_id), a plain request's carries none."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_kv_events=True)
    prompt = list(range(1, 10))
    kv.set_salt("a", b"lora:7", lora_id=7)
    _run(kv, "a", prompt)
    _run(kv, "b", [50 + t for t in prompt])
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert [e.lora_id for e in stored] == [7, None]
    assert msgpack.unpackb(encode_batch(EventBatch(1.0, stored[:1])))[1][0][5] == 7


def test_the_scheduler_names_the_adapter_of_a_requests_blocks() -> None:
    """Through the scheduler (a fake runner): a request with a LoRA adapter stores blocks
    whose event names the adapter's lora_int_id."""
    from tokenmill.config import SchedulerConfig
    from tokenmill.core.sched_output import RunnerOutput
    from tokenmill.core.scheduler import Scheduler
    from tokenmill.lora_request import LoRARequest
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams

    kv = KVCacheManager(64, BS, enable_kv_events=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, 256,
                      max_loras=1)
    request = Request("r", list(range(10, 22)), SamplingParams(temperature=0.0, max_tokens=1),
                      frozenset(), lora_request=LoRARequest("sql", 5, "/nowhere"))
    sched.add_request(request)
    while sched.has_unfinished():
        out = sched.schedule()
        runner = RunnerOutput()
        for rid in out.num_scheduled_tokens:
            runner.sampled_token_ids[rid] = [7]
        sched.update(out, runner)
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert stored and {e.lora_id for e in stored} == {5}


def _dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


def _ask_replay(sock: zmq.Socket, start: int) -> list[tuple[int, list]]:
    """vLLM's replay request (as a REQ socket frames it) and every answer up to the end."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    answers = []
    while True:
        empty, seq, payload = sock.recv_multipart()
        assert empty == b""
        number = int.from_bytes(seq, "big", signed=True)
        if number == -1:
            assert payload == b""
            return answers
        answers.append((number, decode_batch(payload).events))


def test_replay_resends_the_batches_from_a_sequence_number() -> None:
    """vLLM's replay socket: a ROUTER that resends the kept batches from the number asked,
    then the end marker (-1, empty payload); older batches beyond buffer_steps are gone."""
    h = [bytes([i]) * 16 for i in range(5)]
    pub = ZmqEventPublisher(_free_endpoint(), replay_endpoint=(replay := _free_endpoint()),
                            buffer_steps=3)
    sock = _dealer(replay)
    try:
        for i in range(5):
            pub.publish([BlockRemoved([h[i]])])
        assert _ask_replay(sock, 3) == [(3, [BlockRemoved([h[3]])]),
                                        (4, [BlockRemoved([h[4]])])]
        # Batches 0 and 1 fell out of the buffer of three.
        assert [n for n, _ in _ask_replay(sock, 0)] == [2, 3, 4]
        assert _ask_replay(sock, 9) == []
        # A normal batch after the replays is published and kept as before.
        pub.publish([AllBlocksCleared()])
        assert _ask_replay(sock, 5) == [(5, [AllBlocksCleared()])]
    finally:
        sock.close(linger=0)
        pub.close()


def test_replay_endpoint_in_use_names_its_field_and_frees_the_other() -> None:
    taken = _free_endpoint()
    first = ZmqEventPublisher(_free_endpoint(), replay_endpoint=taken)
    endpoint = _free_endpoint()
    try:
        with pytest.raises(ValueError, match="kv_events_replay_endpoint"):
            ZmqEventPublisher(endpoint, replay_endpoint=taken)
        ZmqEventPublisher(endpoint).close()  # the refused one's PUB port was let go
    finally:
        first.close()


def test_the_replay_option_needs_the_events_endpoint() -> None:
    import argparse

    from tokenmill.config import CacheConfig
    from tokenmill.engine.args import add_engine_args, engine_config_from_args

    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        CacheConfig(kv_events_replay_endpoint="tcp://*:5558")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--kv-events-endpoint", "tcp://*:5557",
                         "--kv-events-replay-endpoint", "tcp://*:5558"])
    assert engine_config_from_args(args).cache.kv_events_replay_endpoint == "tcp://*:5558"
