"""`bench throughput` and `bench latency` on the embedded model: what they count adds up."""

from __future__ import annotations

import pytest

from tokenmill.bench.datasets import SampleRequest, random_requests
from tokenmill.bench.latency import Timing, summarize_timings, time_one
from tokenmill.bench.throughput import run_throughput


def test_throughput_counts_every_token(llm) -> None:
    engine = llm.engine
    reqs = random_requests(engine.tokenizer, 3, "5:20", "2:6", seed=0)
    r = run_throughput(engine, reqs, temperature=0.0, progress=False)
    assert r["num_requests"] == 3
    assert r["total_input_tokens"] == sum(q.prompt_len for q in reqs)
    assert r["total_output_tokens"] == sum(q.output_len for q in reqs)  # EOS is ignored
    assert r["output_tokens_per_s"] * r["elapsed_s"] == pytest.approx(r["total_output_tokens"])
    # Every request's first token comes from a step of its own or shared ones; its last from
    # the step of the longest output: at least that many steps, at most one a token.
    assert max(q.output_len for q in reqs) <= r["engine_steps"] <= sum(
        q.prompt_len + q.output_len for q in reqs)
    assert r["ms_per_step"] * r["engine_steps"] == pytest.approx(r["elapsed_s"] * 1000)
    assert not engine.has_unfinished_requests()


def test_time_one_sees_every_token(llm) -> None:
    ids = llm.get_tokenizer().encode("The capital of France is")
    t = time_one(llm.engine, "lat-test", SampleRequest(ids, len(ids), 6), temperature=0.0)
    assert (t.prompt_tokens, t.output_tokens) == (len(ids), 6)
    assert 0 < t.ttft <= t.e2e
    assert t.decode_tps is not None and t.decode_tps > 0


def test_summarize_timings_definitions() -> None:
    timings = [Timing(500, 11, ttft=0.5, e2e=1.5), Timing(500, 11, ttft=1.0, e2e=3.0),
               Timing(500, 11, ttft=0.25, e2e=0.75)]
    s = summarize_timings(timings)
    assert s["prefill_tokens_per_s"] == pytest.approx(1000.0)  # median of 1000, 500, 2000
    assert s["decode_tokens_per_s"] == pytest.approx(10.0)  # median of 10, 5, 20
    assert s["ttft_ms"]["median"] == pytest.approx(500.0)
    assert s["e2e_ms"]["max"] == pytest.approx(3000.0)
    assert Timing(10, 1, ttft=0.1, e2e=0.1).decode_tps is None  # one token: no decode speed
