"""Prompt lookup: guess that the text goes on as it did after the last time its current ending
occurred. No extra model; it pays off where the output copies its input (code edits,
extraction, quoting) and costs one wider verification step when it guesses wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.request import Request
from tokenmill.spec_decode.proposer import Proposal


def ngram_lookup(token_ids: Sequence[int], num_tokens: int, ngram_min: int,
                 ngram_max: int) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram (n from ``ngram_max`` down to ``ngram_min``); [] when none occurred.
    """
    length = len(token_ids)
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # Windows that end before the last token, so at least one token follows each.
        windows = sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return list(token_ids[start:start + num_tokens])
    return []


class NgramProposer:
    """Drafts by :func:`ngram_lookup` over each request's prompt and output."""

    def __init__(self, num_speculative_tokens: int, ngram_min: int, ngram_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        proposals = {}
        for r in requests:
            ids = ngram_lookup(r.all_token_ids, self.num_speculative_tokens, self.ngram_min,
                               self.ngram_max)
            if ids:
                proposals[r.request_id] = Proposal(ids)
        return proposals

    def finish(self, request_ids: Iterable[str]) -> None:
        """Nothing to forget: the lookup keeps no state."""
