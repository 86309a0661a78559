"""Chi-square goodness of fit without scipy (torch's regularized incomplete gamma)."""

from __future__ import annotations

import torch

# Cells expected to hold fewer samples than this are pooled into one, so the statistic stays
# close to its chi-square distribution.
MIN_EXPECTED = 5.0


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observing ``counts`` (any shape) under the distribution ``probs``."""
    counts = counts.flatten().double()
    expected = probs.flatten().double() * counts.sum()
    small = expected < MIN_EXPECTED
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    if (counts[~keep] > 0).any():
        return 0.0  # samples where the distribution has no mass at all
    counts, expected = counts[keep], expected[keep]
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(counts.numel() - 1), dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, stat / 2).item()
