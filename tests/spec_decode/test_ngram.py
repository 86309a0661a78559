"""Prompt lookup: the longest suffix n-gram's most recent earlier occurrence."""

from __future__ import annotations

from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.ngram import NgramProposer, ngram_lookup


def test_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 5, 3, 8, 1, 2, 3]
    # "1 2 3" (n=3) occurred at 0 -> followed by 9 9 5; "3" alone occurred more recently.
    assert ngram_lookup(tokens, 3, 1, 4) == [9, 9, 5]
    assert ngram_lookup(tokens, 2, 1, 4) == [9, 9]


def test_most_recent_occurrence_and_short_continuations() -> None:
    tokens = [4, 5, 6, 4, 5, 7, 4, 5]
    assert ngram_lookup(tokens, 3, 2, 4) == [7, 4, 5]
    # Periodic text: the match right before the end leaves only what exists so far.
    assert ngram_lookup([1, 1, 1, 1], 5, 2, 4) == [1]


def test_no_match_and_ngram_min() -> None:
    assert ngram_lookup([1, 2, 3, 4], 3, 1, 4) == []
    tokens = [7, 1, 2, 7]  # only a 1-gram repeats
    assert ngram_lookup(tokens, 2, 2, 4) == []
    assert ngram_lookup(tokens, 2, 1, 4) == [1, 2]
    assert ngram_lookup([5], 2, 1, 4) == []


def test_proposer_leaves_out_requests_without_a_guess() -> None:
    params = SamplingParams(max_tokens=8)
    hit = Request("hit", [1, 2, 3, 1, 2], params)
    miss = Request("miss", [1, 2, 3, 4], params)
    proposals = NgramProposer(2, 1, 3).propose([hit, miss])
    assert set(proposals) == {"hit"}
    assert proposals["hit"].token_ids == [3, 1] and proposals["hit"].probs is None
