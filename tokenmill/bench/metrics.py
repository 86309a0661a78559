"""Serving metrics with vLLM's definitions, computed from per-request client-side timings.

Everything here is pure Python over plain numbers, so it is unit-tested on synthetic timings:

- TTFT: from sending the request to the first chunk that carries content.
- ITL: every gap between consecutive content chunks (a chunk may hold several tokens).
- TPOT: per request, ``(e2e - TTFT) / (output tokens - 1)``; requests of one token have none.
- E2EL: from sending the request to its last content chunk.
- Throughputs divide by the wall-clock duration of the whole run.
- Goodput: completed requests per second that met every given SLO (ttft / tpot / e2el, ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.metrics.summary import Summary, summarize

# The latency metrics whose percentiles are reported, in the order vLLM prints them.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds."""

    prompt_len: int
    # Output tokens: the server's usage count when it sent one, else the content chunks.
    output_tokens: int = 0
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    # perf_counter() when the request was sent and when its last chunk arrived.
    start_time: float = 0.0
    end_time: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a single token."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class BenchmarkMetrics:
    """The aggregate result of one load-generator run."""

    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    max_concurrent_requests: int
    latencies: dict[str, Summary]


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {GOODPUT_METRICS}, got {spec!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: {value!r} is not a number of ms") from None
        if ms <= 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {ms}")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (a request without a TPOT meets that one)."""
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    for name, limit_ms in slos.items():
        value = values[name]
        if value is not None and value * 1000 > limit_ms:
            return False
    return True


def max_concurrency(results: Sequence[RequestResult]) -> int:
    """The most requests that were in flight at one moment (a sweep over start/end events)."""
    events = []
    for r in results:
        if r.end_time >= r.start_time > 0:
            events += [(r.start_time, 1), (r.end_time, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def calculate_metrics(results: Sequence[RequestResult], duration: float,
                      percentiles: Sequence[float] = (90.0, 99.0),
                      goodput_slos: dict[str, float] | None = None) -> BenchmarkMetrics:
    """Aggregate per-request results of a run that took ``duration`` seconds."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    goodput = None
    if goodput_slos:
        goodput = sum(meets_slos(r, goodput_slos) for r in ok) / duration
    return BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration=duration,
        total_input=total_input, total_output=total_output,
        request_throughput=len(ok) / duration, output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        request_goodput=goodput, max_concurrent_requests=max_concurrency(results),
        latencies={name: summarize(series[name], percentiles) for name in LATENCY_METRICS})


def metrics_to_dict(m: BenchmarkMetrics) -> dict[str, float | int | None]:
    """Flat JSON fields with vLLM's key names (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
    out: dict[str, float | int | None] = {
        "completed": m.completed, "failed": m.failed, "duration": m.duration,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput, "request_goodput": m.request_goodput,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name, s in m.latencies.items():
        out[f"mean_{name}_ms"] = s.mean
        out[f"median_{name}_ms"] = s.median
        out[f"std_{name}_ms"] = s.std
        for p, v in s.percentiles.items():
            out[f"p{p:g}_{name}_ms"] = v
    return out
