"""`tokenmill stream` on stdin: results come out while input is still open, one per record."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time

from stream_helpers import REVIEWS, STREAM_CMD, reference_texts


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


def _take(lines: queue.Queue, n: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    out = []
    while len(out) < n:
        out.append(json.loads(lines.get(timeout=max(0.0, deadline - time.monotonic()))))
    return out


def test_stdin_stream(small_llm):
    proc = subprocess.Popen([*STREAM_CMD, "--max-in-flight", "4"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    try:
        # The first records are answered while stdin is still open: nothing waits for EOF.
        for text in REVIEWS[:3]:
            proc.stdin.write(json.dumps({"text": text, "source": "web"}) + "\n")
        proc.stdin.flush()
        first = _take(lines, 3, timeout=120)
        for text in REVIEWS[3:]:
            proc.stdin.write(json.dumps({"text": text}) + "\n")
        proc.stdin.write("this is not json\n")
        proc.stdin.write(json.dumps({"title": "no text field"}) + "\n")
        proc.stdin.close()
        rest = _take(lines, len(REVIEWS) - 3 + 2, timeout=120)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    results = {r["id"]: r for r in first + rest}
    assert len(results) == len(REVIEWS) + 2

    want = reference_texts(small_llm, REVIEWS)
    assert [results[str(i + 1)]["text"] for i in range(len(REVIEWS))] == want
    assert results["1"]["record"] == {"text": REVIEWS[0], "source": "web"}
    assert results["1"]["usage"]["completion_tokens"] > 0
    latency = results["1"]["latency"]
    assert 0 <= latency["queue_s"] <= latency["ttft_s"] <= latency["e2e_s"]
    assert latency["source_wait_s"] is None  # unknown for a pipe
    bad = results[str(len(REVIEWS) + 1)]
    assert bad["error"].startswith(f"line {len(REVIEWS) + 1}: not valid JSON")
    assert "has no field 'text'" in results[str(len(REVIEWS) + 2)]["error"]
    assert f"{len(REVIEWS) + 2} records ({len(REVIEWS)} ok, 2 errors)" in stderr
    assert "TTFT" in stderr and "end to end" in stderr


def test_stdin_stream_with_a_choice_constraint():
    # MAX_TOKENS would cut "positive"/"negative" apart: give the label room.
    cmd = [*STREAM_CMD, "--max-tokens", "8", "--choice", "positive", "--choice", "negative"]
    records = "".join(json.dumps({"text": t}) + "\n" for t in REVIEWS[:4])
    done = subprocess.run(cmd, input=records, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == 4
    for r in results:
        assert r["text"] in ("positive", "negative") and r["finish_reason"] == "stop", r
