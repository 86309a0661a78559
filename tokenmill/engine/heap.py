"""Giving the C heap's free pages back to the OS while a CPU engine serves (glibc only).

A prompt step or a batched decode step allocates and frees tens of megabytes of temporaries
(activations, the int kernels' quantized inputs, logits). glibc keeps freed memory in its heap
for reuse, and the next steps' allocations do not land on the same pages, so the free part of
the heap stays resident and grows: on a 2-core Xeon the embedded model served 32 streams of
128 + 128 tokens and ended with ~60 MB of free but resident heap; ``malloc_trim`` gave it back
in ~2 ms. The engine trims at most once a second, and only after steps of more than one token,
so a single stream's decode steps, which allocate little, never wait for it. The trimmer is one
of the engine core's step consumers: it reads each step's StepStats, once the step is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenmill.metrics.stats import StepStats
from tokenmill.utils import malloc_trim

# Seconds between two trims at most (each ~2 ms on the embedded model: <= 0.2% of the time).
TRIM_INTERVAL_S = 1.0


class HeapTrimmer:
    """Trims the heap after a step of more than one token, at most every ``interval_s``
    (TRIM_INTERVAL_S by default); a step consumer (called with each step's StepStats)."""

    def __init__(self, trim: Callable[[int], int], interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._trim, self._clock = trim, clock
        self.interval_s = TRIM_INTERVAL_S if interval_s is None else interval_s
        self._last = clock()
        self.trims = 0  # how many times it trimmed (tests, debugging)

    @classmethod
    def for_device(cls, is_cuda: bool) -> HeapTrimmer | None:
        """A trimmer for a CPU engine where the C library has ``malloc_trim``; None otherwise
        (a GPU engine's temporaries live in the device's memory)."""
        trim = None if is_cuda else malloc_trim()
        return None if trim is None else cls(trim)

    def __call__(self, stats: StepStats) -> None:
        """Consume one step's stats: trim if it is time to."""
        self.after_step(stats.num_batched_tokens)

    def after_step(self, num_tokens: int) -> None:
        """Called after each step with the tokens it computed."""
        if num_tokens <= 1:
            return
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        self._trim(0)
        self._last = self._clock()
        self.trims += 1
