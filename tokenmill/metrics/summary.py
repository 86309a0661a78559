"""Percentiles and mean / median / std of latency samples, for every report that prints them.

The load generator (``tokenmill.bench.metrics``), the offline latency benchmark and the stream
job's exit summary all describe latencies the same way: given in seconds, reported in
milliseconds, percentiles interpolated as numpy's default.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Summary:
    """mean / median / std and the chosen percentiles of one latency metric, in ms."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default."""
    if not values:
        return 0.0
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> Summary:
    """Summary of values given in seconds, reported in milliseconds (zeros when empty)."""
    ms = [v * 1000 for v in values_s]
    if not ms:
        return Summary(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
    return Summary(mean=statistics.fmean(ms), median=statistics.median(ms),
                   std=statistics.pstdev(ms), percentiles={p: percentile(ms, p) for p in percentiles})
