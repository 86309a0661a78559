"""vLLM's serving metrics on synthetic timings, where every number can be worked out by hand."""

from __future__ import annotations

import pytest

from tokenmill.bench.metrics import (
    RequestResult,
    calculate_metrics,
    max_concurrency,
    meets_slos,
    metrics_to_dict,
    parse_goodput,
)


def request(ttft: float, gaps: list[float], prompt_len: int = 10, start: float = 1.0,
            tokens: int | None = None) -> RequestResult:
    """A completed request whose content chunks came ``ttft`` then ``gaps`` seconds apart."""
    latency = ttft + sum(gaps)
    return RequestResult(prompt_len=prompt_len, output_tokens=tokens or len(gaps) + 1,
                         success=True, ttft=ttft, itl=list(gaps), latency=latency,
                         start_time=start, end_time=start + latency)


def test_tpot_excludes_the_first_token() -> None:
    r = request(ttft=0.5, gaps=[0.1, 0.1, 0.1, 0.1])  # 5 tokens, e2e 0.9 s
    assert r.tpot == pytest.approx(0.1)
    assert request(ttft=0.5, gaps=[]).tpot is None  # one token: no TPOT
    # Several tokens per chunk: TPOT divides by tokens, ITL stays per chunk.
    assert request(ttft=0.5, gaps=[0.4], tokens=5).tpot == pytest.approx(0.1)


def test_calculate_metrics_counts_and_rates() -> None:
    results = [
        request(0.2, [0.05] * 9, prompt_len=100),  # 10 tokens
        request(0.4, [0.10] * 4, prompt_len=50),  # 5 tokens
        RequestResult(prompt_len=70, error="HTTP 503"),  # failed: counts nowhere else
    ]
    m = calculate_metrics(results, duration=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input, m.total_output) == (150, 15)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(7.5)
    assert m.total_token_throughput == pytest.approx(82.5)
    assert m.request_goodput is None
    ttft = m.latencies["ttft"]
    assert ttft.mean == pytest.approx(300.0) and ttft.percentiles[50] == pytest.approx(300.0)
    assert m.latencies["tpot"].mean == pytest.approx(75.0)  # (50 + 100) / 2
    itl = m.latencies["itl"]  # 13 gaps: 9 of 50 ms, 4 of 100 ms
    assert itl.mean == pytest.approx((9 * 50 + 4 * 100) / 13)
    assert itl.median == pytest.approx(50.0)
    assert m.latencies["e2el"].mean == pytest.approx((650 + 800) / 2)


def test_goodput_counts_requests_within_every_slo() -> None:
    fast = request(0.1, [0.02] * 9)
    slow_first = request(2.0, [0.02] * 9)
    slow_decode = request(0.1, [0.5] * 9)
    slos = parse_goodput(["ttft:500", "tpot:100"])
    assert slos == {"ttft": 500.0, "tpot": 100.0}
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_decode)] == [True, False, False]
    m = calculate_metrics([fast, slow_first, slow_decode], duration=4.0, goodput_slos=slos)
    assert m.request_goodput == pytest.approx(0.25)
    assert m.request_throughput == pytest.approx(0.75)


@pytest.mark.parametrize("spec", ["ttft", "ttft:", "speed:10", "ttft:-1", "tpot:abc"])
def test_parse_goodput_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([spec])


def test_max_concurrency_sweeps_start_and_end() -> None:
    a = RequestResult(1, success=True, start_time=1.0, end_time=3.0)
    b = RequestResult(1, success=True, start_time=2.0, end_time=4.0)
    c = RequestResult(1, success=True, start_time=3.0, end_time=5.0)  # starts as a ends
    assert max_concurrency([a, b, c]) == 2
    assert max_concurrency([a]) == 1
    assert max_concurrency([]) == 0


def test_metrics_to_dict_uses_vllm_key_names() -> None:
    m = calculate_metrics([request(0.2, [0.05] * 3)], duration=1.0, percentiles=[90, 99.9])
    d = metrics_to_dict(m)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99.9"):
            assert f"{stat}_{name}_ms" in d
    assert d["completed"] == 1 and d["total_output_tokens"] == 4


def test_duration_must_be_positive() -> None:
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics([], duration=0.0)
