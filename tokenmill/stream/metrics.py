"""Per-record latencies of a stream job, summarized when it exits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.metrics.summary import summarize
from tokenmill.stream.records import StreamResult

PERCENTILES = (50.0, 90.0, 99.0)
# Latency fields of a result, and their names in the summary.
_METRICS = {"source_wait_s": "source wait", "queue_s": "queue", "ttft_s": "TTFT",
            "e2e_s": "end to end"}


@dataclass
class StreamStats:
    """Counts and latencies of the records this process answered."""

    ok: int = 0
    errors: int = 0
    output_tokens: int = 0
    latencies: dict[str, list[float]] = field(
        default_factory=lambda: {name: [] for name in _METRICS})
    start: float = field(default_factory=time.monotonic)

    def add(self, result: StreamResult) -> None:
        if result.error is not None:
            self.errors += 1
            return
        self.ok += 1
        if result.usage is not None:
            self.output_tokens += result.usage.completion_tokens
        if result.latency is not None:
            for name, values in self.latencies.items():
                value = getattr(result.latency, name)
                if value is not None:
                    values.append(value)

    def summary(self) -> str:
        """A few lines for stderr: throughput, then latency percentiles in milliseconds."""
        secs = max(time.monotonic() - self.start, 1e-9)
        lines = [f"stream: {self.ok + self.errors} records ({self.ok} ok, {self.errors} errors) "
                 f"in {secs:.1f} s: {(self.ok + self.errors) / secs:.2f} records/s, "
                 f"{self.output_tokens / secs:.1f} output tok/s"]
        header = "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p99", "max"))
        lines.append(f"{'latency (ms)':<14}{header}")
        for name, label in _METRICS.items():
            values = self.latencies[name]
            if not values:
                continue
            s = summarize(values, PERCENTILES)
            row = [s.mean, *(s.percentiles[p] for p in PERCENTILES), max(values) * 1000]
            lines.append(f"{label:<14}" + "".join(f"{v:>10.1f}" for v in row))
        return "\n".join(lines)
