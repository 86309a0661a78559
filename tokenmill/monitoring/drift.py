"""Population stability index (PSI) between a reference sample and a live one.

PSI = sum over bins of (live% - ref%) * ln(live% / ref%). The bins are fixed by the reference:
for a numeric signal its quantiles (so each bin holds about as many reference values), for a
categorical one its categories (and any the live sample adds). Shares are smoothed by half a
count per bin, so a bin that one side never saw gives a large but finite term.

Read it as the usual rule of thumb says: under 0.1 no real change, 0.1 to 0.25 a moderate one,
above 0.25 a major one. With n values per side and k bins, pure sampling noise gives about
(k - 1) * (1/n_ref + 1/n_live), which is why ``numeric_bins`` gives small samples few bins.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Half a count added to every bin of both sides (Jeffreys' smoothing): no log of zero.
SMOOTHING = 0.5
# At most this many bins, and at least this many reference values per bin.
MAX_BINS = 10
VALUES_PER_BIN = 25


def numeric_bins(num_values: int) -> int:
    """Bins for a numeric signal whose smaller sample has ``num_values`` values (2 to 10)."""
    return max(2, min(MAX_BINS, num_values // VALUES_PER_BIN))


def quantile_edges(reference: Sequence[float], bins: int) -> np.ndarray:
    """Inner bin edges at the reference's quantiles: bin i is (edge[i-1], edge[i]]; ties
    merge bins (a reference of one repeated value has two: up to it, above it)."""
    if not len(reference):
        raise ValueError("the reference has no values")
    qs = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    edges = np.unique(np.quantile(np.asarray(reference, dtype=np.float64), qs))
    if edges.size == 0:  # bins == 1: one edge at the median still separates a shift
        edges = np.asarray([float(np.median(reference))])
    return edges


def bin_counts(values: Sequence[float], edges: np.ndarray) -> np.ndarray:
    """How many ``values`` fall in each of the ``len(edges) + 1`` bins."""
    idx = np.searchsorted(edges, np.asarray(values, dtype=np.float64), side="left")
    return np.bincount(idx, minlength=edges.size + 1)


def psi_from_counts(ref_counts: Sequence[float], live_counts: Sequence[float]) -> float:
    """PSI of two histograms over the same bins (smoothed, see the module)."""
    ref = np.asarray(ref_counts, dtype=np.float64) + SMOOTHING
    live = np.asarray(live_counts, dtype=np.float64) + SMOOTHING
    ref /= ref.sum()
    live /= live.sum()
    return float(np.sum((live - ref) * np.log(live / ref)))


def numeric_psi(reference: Sequence[float], live: Sequence[float],
                bins: int | None = None) -> float:
    """PSI of a numeric signal over the reference's quantile bins (``bins`` None: by the
    smaller sample's size, see ``numeric_bins``)."""
    if not len(reference) or not len(live):
        raise ValueError("both samples need values")
    if bins is None:
        bins = numeric_bins(min(len(reference), len(live)))
    edges = quantile_edges(reference, bins)
    return psi_from_counts(bin_counts(reference, edges), bin_counts(live, edges))


def category_counts(values: Iterable[Hashable]) -> dict[Hashable, int]:
    """How often each category occurs."""
    counts: dict[Hashable, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return counts


def categorical_psi(reference: Iterable[Hashable], live: Iterable[Hashable]) -> float:
    """PSI of a categorical signal over the categories either side has."""
    ref, cur = category_counts(reference), category_counts(live)
    if not ref or not cur:
        raise ValueError("both samples need values")
    cats = list(ref.keys() | cur.keys())
    return psi_from_counts([ref.get(c, 0) for c in cats], [cur.get(c, 0) for c in cats])


def cosine_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """1 - cos(a, b); 1.0 when either is all zeros."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"vectors of different lengths: {x.size} and {y.size}")
    norm = float(np.linalg.norm(x) * np.linalg.norm(y))
    return 1.0 if norm == 0.0 else 1.0 - float(x @ y) / norm


@dataclass
class Summary:
    """What a sample of one signal looks like, for the JSON view."""

    count: int
    # Numeric: mean, median, 90th percentile. Categorical: each category's share.
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    shares: dict[str, float] | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"count": self.count}
        if self.shares is not None:
            out["shares"] = self.shares
        else:
            out.update(mean=self.mean, p50=self.p50, p90=self.p90)
        return out


def summarize(values: Sequence[object], numeric: bool) -> Summary:
    """The count and mean/median/p90 (numeric) or shares (categorical) of a sample."""
    if not values:
        return Summary(0)
    if not numeric:
        counts = category_counts(values)  # type: ignore[arg-type]
        return Summary(len(values), shares={str(k): round(v / len(values), 4)
                                            for k, v in sorted(counts.items(),
                                                               key=lambda kv: -kv[1])})
    arr = np.asarray(values, dtype=np.float64)
    mean, p50, p90 = float(arr.mean()), *map(float, np.quantile(arr, [0.5, 0.9]))
    return Summary(len(values), *(None if math.isnan(x) else round(x, 4)
                                  for x in (mean, p50, p90)))
