"""Statistics the engine loop emits as plain data after every step; loggers consume them.

The loop that drives an ``LLMEngine`` feeds every RequestOutput it delivers (in DELTA mode, or
the final output of an abort) to a ``StatsCollector``, which turns one step's outputs into an
``IterationStats``. Loggers (Prometheus, a log line) get that and the scheduler's snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.core.sched_output import SchedulerStats
from tokenmill.outputs import RequestOutput


@dataclass
class FinishedRequestStats:
    """One finished sequence (a choice of a request; there are ``n`` per request)."""

    finish_reason: str
    # Seconds from arrival to the end; None only when the engine never stamped it.
    e2e_latency: float | None
    # Seconds from arrival to first being scheduled; None if it never ran (aborted in the queue).
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What happened in one engine step (or one round of aborts between steps)."""

    # Requests and tokens the step computed (0 for a round without a model step).
    batch_size: int = 0
    num_batched_tokens: int = 0
    # Prompt tokens of requests whose first output token came this step.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """Anything that consumes the engine's statistics (called on the engine thread)."""

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        """Take one step's statistics and the scheduler's state after it."""


class StatsCollector:
    """Turns the RequestOutputs of DELTA-mode requests into IterationStats."""

    def __init__(self) -> None:
        # request id -> output tokens generated so far, per sequence
        self._generated: dict[str, list[int]] = {}

    def observe(self, outputs: list[RequestOutput], batch_size: int = 0,
                num_batched_tokens: int = 0) -> IterationStats:
        """Statistics of one step from the outputs it produced (deltas, not cumulative)."""
        stats = IterationStats(batch_size=batch_size, num_batched_tokens=num_batched_tokens)
        for out in outputs:
            self._observe_one(out, stats)
        return stats

    def _observe_one(self, out: RequestOutput, stats: IterationStats) -> None:
        counts = self._generated.setdefault(out.request_id, [0] * len(out.outputs))
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if sum(counts) == 0 and new_tokens > 0:
            stats.num_prompt_tokens += len(out.prompt_token_ids)
            ttft = out.metrics.time_to_first_token
            if ttft is not None:
                stats.time_to_first_tokens.append(ttft)
        stats.num_generation_tokens += new_tokens
        for c in out.outputs:
            counts[c.index] += len(c.token_ids)
            stats.inter_token_latencies.extend(c.inter_token_latencies)
        if not out.finished:
            return
        del self._generated[out.request_id]
        for c in out.outputs:
            stats.finished.append(FinishedRequestStats(
                finish_reason=c.finish_reason or "abort",
                e2e_latency=out.metrics.e2e_latency,
                queue_time=out.metrics.queue_time,
                num_prompt_tokens=len(out.prompt_token_ids),
                num_generation_tokens=counts[c.index]))
