"""`tokenmill stream` on Redis Streams: a consumer killed mid-stream and another started after it
lose nothing; and the two ways pending entries come back (own PEL, XAUTOCLAIM)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from stream_helpers import REVIEWS, STREAM_CMD, read_results, reference_texts

from tokenmill.stream.redis_io import RedisSource

IN, OUT, GROUP = "reviews", "labels", "workers"


def _add_records(client, texts: list[str]) -> list[str]:
    return [client.xadd(IN, {"text": t}) for t in texts]


def _consumer(server, name: str, *extra: str) -> subprocess.Popen:
    cmd = [*STREAM_CMD, "--redis-url", server.url, "--input-stream", IN, "--group", GROUP,
           "--consumer", name, "--output-stream", OUT, "--max-in-flight", "3", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_consumer_killed_and_restarted_loses_nothing(redis_server, small_llm):
    client = redis_server.client()
    texts = REVIEWS * 2  # 24 records
    ids = _add_records(client, texts)

    # Up to 8 records in flight, and the kill only once some are read but unanswered: with 3,
    # a fast engine could answer and acknowledge all it held just before the kill (seen once).
    # The consumer is stopped (SIGSTOP) before the check, so it cannot acknowledge what it
    # holds between the check and the kill; if it held nothing then, it goes on and we retry.
    first = _consumer(redis_server, "worker-1", "--max-in-flight", "8")
    deadline = time.monotonic() + 120
    while first.poll() is None and time.monotonic() < deadline:
        if client.xlen(OUT) >= 3 and client.xpending(IN, GROUP)["pending"] > 0:
            os.kill(first.pid, signal.SIGSTOP)
            if client.xpending(IN, GROUP)["pending"] > 0:
                break
            os.kill(first.pid, signal.SIGCONT)
        time.sleep(0.01)
    if first.poll() is not None:
        pytest.fail(f"the consumer ended before it could be killed:\n{first.stderr.read()}")
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    first.stderr.close()
    pending = client.xpending(IN, GROUP)["pending"]
    assert pending > 0, "the kill must leave entries read but not acknowledged"
    assert client.xlen(OUT) < len(ids)

    # Another consumer takes the dead one's pending entries over (XAUTOCLAIM) and reads the rest.
    second = _consumer(redis_server, "worker-2", "--claim-idle-ms", "500",
                       "--exit-when-idle", "2")
    _, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    assert client.xpending(IN, GROUP)["pending"] == 0

    results = read_results(client, OUT)
    assert set(results) == set(ids)  # every record answered (at-least-once: maybe twice)
    want = dict(zip(ids, reference_texts(small_llm, texts), strict=True))
    for entry_id, answers in results.items():
        assert all(a["text"] == want[entry_id] and a["error"] is None for a in answers)
        assert answers[0]["record"] == {"text": texts[ids.index(entry_id)]}
        assert answers[0]["latency"]["source_wait_s"] >= 0


def _source(client, consumer: str, claim_idle_ms: int = 60_000) -> RedisSource:
    return RedisSource(client, IN, GROUP, consumer, claim_idle_ms=claim_idle_ms)


def test_pending_entries_come_back(redis_server):
    client = redis_server.client()
    ids = _add_records(client, ["a", "b", "c", "d", "e"])

    dead = _source(client, "w1")
    assert [r.id for r in dead.read(3, 0.0)] == ids[:3]  # read, never acknowledged: w1 "dies"

    # Restarted under the same name: its own pending entries come first, then new ones.
    again = _source(client, "w1")
    assert [r.id for r in again.read(10, 0.0)] == ids[:3]
    assert [r.id for r in again.read(10, 0.0)] == ids[3:]

    # Another consumer takes over what w1 left pending once it has been idle long enough.
    other = _source(client, "w2", claim_idle_ms=50)
    time.sleep(0.1)
    claimed = other.read(10, 0.0)
    assert sorted(r.id for r in claimed) == ids
    other.ack(claimed)
    assert client.xpending(IN, GROUP)["pending"] == 0
    assert other.read(10, 0.05) == []

    # An entry deleted while pending is acknowledged and skipped, not answered.
    late = _add_records(client, ["f"])
    assert [r.id for r in _source(client, "w3").read(1, 0.0)] == late
    client.xdel(IN, late[0])
    assert _source(client, "w3").read(10, 0.0) == []
    assert client.xpending(IN, GROUP)["pending"] == 0
