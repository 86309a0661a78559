"""`tokenmill bench serve` against a real `tokenmill serve` on 127.0.0.1: structure and counts.

No timing thresholds: only that the result file is complete and its numbers add up, with the
client's token counts matching the server's own counters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from server_harness import Server, start_server, wait_for

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, WARMUP_TOKENS = 6, 16, 8, 8


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--max-num-seqs", "4")
    yield s
    assert s.stop() == 0, s.log()


def bench(server: Server, result_file: str, *args: str) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "tokenmill", "-q", "bench", "serve", "--base-url", server.url,
           "--no-progress", "--result-file", result_file, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(result_file, encoding="utf-8") as f:
        return json.load(f), proc.stdout


def test_random_workload_counts_add_up(server: Server, tmp_path) -> None:
    before = server.metrics()
    r, stdout = bench(server, str(tmp_path / "r.json"), "--num-prompts", str(NUM_PROMPTS),
                      "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                      "--max-concurrency", "3", "--request-rate", "50", "--seed", "1",
                      "--goodput", "ttft:600000", "e2el:600000")
    assert "Serving Benchmark Result" in stdout
    assert (r["model"], r["num_prompts"], r["max_concurrency"]) == (server.model, NUM_PROMPTS, 3)
    assert (r["completed"], r["failed"]) == (NUM_PROMPTS, 0)
    assert r["errors"] == [""] * NUM_PROMPTS
    # Prompts of exactly INPUT_LEN tokens (built with the server's /tokenize), outputs of
    # exactly OUTPUT_LEN (ignore_eos), and the totals are their sums.
    assert r["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
    assert r["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert r["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert r["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert r["request_throughput"] * r["duration"] == pytest.approx(NUM_PROMPTS)
    assert r["output_throughput"] * r["duration"] == pytest.approx(NUM_PROMPTS * OUTPUT_LEN)
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs
    assert 1 <= r["max_concurrent_requests"] <= 3
    for ttft, e2el, itl in zip(r["ttfts"], r["e2els"], r["itls"], strict=True):
        assert 0 < ttft <= e2el
        assert 1 <= len(itl) <= OUTPUT_LEN - 1  # one gap per content chunk after the first
        assert ttft + sum(itl) == pytest.approx(e2el)
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = [r[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p90", "p99")]
        assert all(v > 0 for v in s) and r[f"median_{name}_ms"] <= r[f"p99_{name}_ms"]
    # The server generated what the client counted (plus the warm-up request).
    expected = before["tokenmill:generation_tokens_total"] + NUM_PROMPTS * OUTPUT_LEN \
        + WARMUP_TOKENS
    assert wait_for(lambda: server.metrics()["tokenmill:generation_tokens_total"] == expected)


def test_jsonl_workload_with_a_local_tokenizer(server: Server, smollm_path: str,
                                               tmp_path) -> None:
    data = tmp_path / "w.jsonl"
    data.write_text(json.dumps({"prompt": "The capital of France is", "output_len": 3}) + "\n"
                    + json.dumps({"prompt_token_ids": [504, 3575, 282], "output_len": 5}) + "\n")
    r, _ = bench(server, str(tmp_path / "r.json"), "--dataset", str(data), "--tokenizer",
                 smollm_path, "--num-warmups", "0")
    assert (r["completed"], r["num_prompts"]) == (2, 2)
    assert r["input_lens"] == [5, 3] and r["output_lens"] == [3, 5]
    assert r["total_output_tokens"] == 8 and r["dataset"] == str(data)
