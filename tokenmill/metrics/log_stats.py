"""A periodic line in the log with what an engine did lately, as vLLM prints it: prompt and
generation throughput, running and waiting requests, KV cache usage, prefix-cache hit rate.
Only when something happened since the last line: an idle server stays silent."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenmill.metrics.stats import IterationStats, SchedulerStats

logger = logging.getLogger("tokenmill.stats")


class LoggingStatLogger:
    """Logs one model's activity every ``interval`` seconds (a StatLogger: ``record`` is fed
    every engine step)."""

    def __init__(self, model_name: str, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model_name = model_name
        self.interval = interval
        self.clock = clock
        self._last = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._queries = 0
        self._hits = 0
        self._last_state: tuple[int, int] = (0, 0)

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        now = self.clock()
        if now - self._last < self.interval:
            return
        state = (scheduler.num_running, scheduler.num_waiting)
        if self._prompt_tokens or self._generation_tokens or state != self._last_state:
            logger.info(self.line(scheduler, now - self._last))
        self._last, self._last_state = now, state
        self._prompt_tokens = self._generation_tokens = 0
        self._queries = scheduler.prefix_cache_queries_total
        self._hits = scheduler.prefix_cache_hits_total

    def line(self, scheduler: SchedulerStats, seconds: float) -> str:
        """The log line for ``seconds`` since the last one."""
        queries = scheduler.prefix_cache_queries_total - self._queries
        hits = scheduler.prefix_cache_hits_total - self._hits
        hit_rate = f"{100 * hits / queries:.1f}%" if queries else "-"
        return (f"{self.model_name}: Avg prompt throughput: {self._prompt_tokens / seconds:.1f} "
                f"tokens/s, Avg generation throughput: {self._generation_tokens / seconds:.1f} "
                f"tokens/s, Running: {scheduler.num_running} reqs, Waiting: "
                f"{scheduler.num_waiting} reqs, KV cache usage: "
                f"{100 * scheduler.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate}")
