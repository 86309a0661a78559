"""Statistics the engine loop emits as plain data after every step; loggers consume them.

The loop that drives an ``LLMEngine`` feeds every RequestOutput it delivers (in DELTA mode, or
the final output of an abort) to a ``StatsCollector``, which turns one step's outputs into an
``IterationStats``. Loggers (Prometheus, a log line) get that and the scheduler's snapshot.

Inside the engine, ``EngineCore`` hands each model step's ``StepStats`` to the step consumers
registered on it (compute, energy and cost accounting; heap trimming): they read the step as
data and never run inside the step itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.outputs import ComputeUsage, RequestMetrics, RequestOutput


@dataclass
class SpecDecodingStats:
    """What was proposed and accepted since the engine started.

    A "draft" is one request's proposal verified in one step; it yields ``accepted + 1`` tokens
    (the accepted drafts and the target's own next token).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose token i (0-based) was accepted.
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verified draft of ``num_draft_tokens`` tokens, ``num_accepted`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        missing = num_accepted - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position.extend([0] * missing)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per verified draft: accepted + 1 (1.0 before any draft)."""
        if not self.num_drafts:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_position))


@dataclass(frozen=True)
class StepStats:
    """One model step as plain data, handed to the engine core's step consumers when its
    tokens are back (before the scheduler turns them into outputs, so that what a consumer
    charges a request shows in that step's outputs)."""

    # Tokens each request computed in the step (request id -> tokens); read-only.
    num_scheduled_tokens: Mapping[str, int]
    # Requests and tokens the step computed.
    batch_size: int
    num_batched_tokens: int
    # Seconds and joules from the start of the EngineCore.step() call that finished the step
    # to the moment its tokens were back; ``energy_estimated``: the joules include the CPU
    # estimate of tokenmill.metrics.economics (no counter to read).
    seconds: float
    energy_joules: float
    energy_estimated: bool


# Something that takes each step's StepStats (called on the engine thread, in order).
StepConsumer = Callable[[StepStats], None]


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler for loggers and metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    num_scheduled_tokens: int = 0
    # Prompt tokens looked up in the prefix cache and found there, since the start.
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Running totals of speculative decoding; None when the engine does not speculate.
    spec_decoding: SpecDecodingStats | None = None
    # Time, energy and cost of every step since the start.
    usage_total: ComputeUsage = field(default_factory=ComputeUsage)
    # LoRA adapters (names) of the running and the waiting requests, and the adapters a step
    # may run; max_loras 0: the engine serves none.
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0


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
    # For the quality monitor (tokenmill/monitoring): the prompt's text (None when it came as token
    # ids), what stopped the output (a stop string or token id; None for eos, length, abort),
    # and the mean raw logprob of its tokens (None without tokens or logprobs).
    prompt: str | None = None
    stop_reason: int | str | None = None
    mean_logprob: float | None = None
    # Seconds from first scheduled to first token (prefill), first token to finish (decode),
    # and first scheduled to finish (inference); None where the sequence never got there.
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    # The request's max_tokens (None: up to the context).
    max_tokens: int | None = None


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
            n = counts[c.index]
            stats.finished.append(FinishedRequestStats(
                finish_reason=c.finish_reason or "abort",
                e2e_latency=out.metrics.e2e_latency,
                queue_time=out.metrics.queue_time,
                num_prompt_tokens=len(out.prompt_token_ids),
                num_generation_tokens=n,
                prompt=out.prompt,
                stop_reason=c.stop_reason,
                mean_logprob=(c.cumulative_logprob / n
                              if c.cumulative_logprob is not None and n else None),
                max_tokens=out.metrics.max_tokens, **_phases(out.metrics)))


def _phases(m: RequestMetrics) -> dict[str, float | None]:
    """A finished request's prefill, decode and inference seconds (vLLM's phases)."""
    def span(start: float | None, end: float | None) -> float | None:
        return end - start if start is not None and end is not None else None

    return {"prefill_time": span(m.first_scheduled_time, m.first_token_time),
            "decode_time": span(m.first_token_time, m.finished_time),
            "inference_time": span(m.first_scheduled_time, m.finished_time)}
