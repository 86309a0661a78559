"""Latency summaries shared by the benchmarks and the stream job, on numbers worked out by hand."""

from __future__ import annotations

import pytest

from tokenmill.metrics.summary import percentile, summarize


def test_percentile_interpolates_like_numpy() -> None:
    data = [1.0, 2.0, 3.0, 4.0]
    assert percentile(data, 50) == 2.5
    assert percentile(data, 90) == pytest.approx(3.7)
    assert percentile(data, 99) == pytest.approx(3.97)
    assert percentile(data, 0) == 1.0 and percentile(data, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError, match="percentile"):
        percentile(data, 101)


def test_summarize_reports_milliseconds() -> None:
    s = summarize([0.1, 0.2, 0.3], [90])
    assert s.mean == pytest.approx(200.0)
    assert s.median == pytest.approx(200.0)
    assert s.percentiles[90] == pytest.approx(280.0)
    empty = summarize([], [99])
    assert (empty.mean, empty.median, empty.percentiles) == (0.0, 0.0, {99: 0.0})
