"""`tokenmill batch` killed with SIGKILL mid-job, then run again with the same arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from batch_helpers import BATCH_CMD, by_custom_id, completion, read_results, texts, write_jsonl

from tokenmill.batch import run_batch

NUM_LINES = 24


def _lines_in(path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def test_resume_after_sigkill(tmp_path, small_llm):
    lines = [completion(f"r{i}", f"Item {i}: the number {i * 7} is", max_tokens=8)
             for i in range(NUM_LINES)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    cmd = [*BATCH_CMD, "-i", str(inp), "-o", str(out), "--max-in-flight", "2"]

    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while _lines_in(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.fail(f"the job ended before it could be killed:\n{proc.stderr.read()}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    answered_before = _lines_in(out)
    assert 0 < answered_before < NUM_LINES, "the kill must land in the middle of the job"
    with open(out, "ab") as f:  # the kill may also cut a line in half: make sure it did
        f.write(b'{"id": "batch_req_24", "custom_id": "r23", "resp')

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{NUM_LINES - answered_before} lines answered" in done.stderr
    results = by_custom_id(read_results(out))  # every line parses, none is repeated
    assert set(results) == {f"r{i}" for i in range(NUM_LINES)}

    # The same answers as one uninterrupted run (greedy).
    ref_out = tmp_path / "ref.jsonl"
    run_batch(str(inp), str(ref_out), small_llm.engine, max_in_flight=2, progress=False)
    ref = by_custom_id(read_results(ref_out))
    assert {k: texts(r) for k, r in results.items()} == {k: texts(r) for k, r in ref.items()}
