"""What one model did lately, for the web dashboard: throughput over the last seconds,
TTFT and ITL percentiles of recent requests, the scheduler's state, the prefix cache, the
speculative acceptance and the energy and cost per 1,000 tokens. Fed every engine step (a
StatLogger, on the engine thread) and read as JSON by the server (on the event loop)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tokenmill.metrics.stats import IterationStats, SchedulerStats

# Seconds of steps the throughput is averaged over.
WINDOW_S = 10.0
# Recent latencies kept for the percentiles.
MAX_SAMPLES = 2000


def percentiles(values: list[float], qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    """``{"p50": ..., ...}`` of ``values`` (nearest rank); empty without values."""
    if not values:
        return {}
    ordered = sorted(values)
    return {f"p{q:g}": ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
            for q in qs}


class LiveStats:
    """One model's recent activity (see the module)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, int, int]] = deque()  # (time, prompt, generated)
        self._ttft: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._itl: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._scheduler = SchedulerStats()
        self._output_tokens = 0
        self._prompt_tokens = 0
        self._finished = 0

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        now = self.clock()
        with self._lock:
            self._scheduler = scheduler
            if iteration.num_prompt_tokens or iteration.num_generation_tokens:
                self._steps.append((now, iteration.num_prompt_tokens,
                                    iteration.num_generation_tokens))
            while self._steps and self._steps[0][0] < now - WINDOW_S:
                self._steps.popleft()
            self._ttft.extend(iteration.time_to_first_tokens)
            self._itl.extend(iteration.inter_token_latencies)
            self._prompt_tokens += iteration.num_prompt_tokens
            self._output_tokens += iteration.num_generation_tokens
            self._finished += len(iteration.finished)

    def snapshot(self) -> dict[str, Any]:
        """The JSON the dashboard reads."""
        now = self.clock()
        with self._lock:
            steps = [s for s in self._steps if s[0] >= now - WINDOW_S]
            s = self._scheduler
            ttft, itl = list(self._ttft), list(self._itl)
            output_tokens, prompt_tokens = self._output_tokens, self._prompt_tokens
            finished = self._finished
        usage = s.usage_total
        per_k = 1000 / output_tokens if output_tokens else None
        spec = s.spec_decoding
        return {
            "prompt_tokens_per_s": sum(p for _, p, _ in steps) / WINDOW_S,
            "output_tokens_per_s": sum(g for _, _, g in steps) / WINDOW_S,
            "running": s.num_running, "waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage,
            "prefix_cache_hit_rate": (s.prefix_cache_hits_total / s.prefix_cache_queries_total
                                      if s.prefix_cache_queries_total else None),
            "spec_acceptance_rate": (spec.num_accepted_tokens / spec.num_draft_tokens
                                     if spec is not None and spec.num_draft_tokens else None),
            "ttft_seconds": percentiles(ttft), "itl_seconds": percentiles(itl),
            "prompt_tokens_total": prompt_tokens, "output_tokens_total": output_tokens,
            "finished_total": finished,
            "joules_per_1k_output_tokens": usage.energy_joules * per_k if per_k else None,
            "usd_per_1k_output_tokens": usage.cost_usd * per_k if per_k else None,
            "energy_estimated": usage.energy_estimated,
        }
