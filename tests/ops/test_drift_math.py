"""The population stability index, its bins, and the prompt-script classifier."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from tokenmill.monitoring.drift import (
    SMOOTHING,
    bin_counts,
    categorical_psi,
    cosine_distance,
    numeric_bins,
    numeric_psi,
    psi_from_counts,
    quantile_edges,
    summarize,
)
from tokenmill.monitoring.scripts import TAIL_CHARS, prompt_script
from tokenmill.monitoring.signals import stop_kind


def test_psi_matches_the_formula() -> None:
    ref, live = [50, 30, 20], [20, 30, 50]
    r = (np.array(ref) + SMOOTHING) / (sum(ref) + 3 * SMOOTHING)
    cur = (np.array(live) + SMOOTHING) / (sum(live) + 3 * SMOOTHING)
    expected = sum((c - e) * math.log(c / e) for c, e in zip(cur, r, strict=True))
    assert psi_from_counts(ref, live) == pytest.approx(expected)
    # Symmetric in its two sides, zero for equal histograms, positive otherwise.
    assert psi_from_counts(live, ref) == pytest.approx(expected)
    assert psi_from_counts(ref, ref) == 0.0
    assert expected > 0.25


def test_an_empty_bin_gives_a_large_finite_term() -> None:
    score = psi_from_counts([100, 0], [0, 100])
    assert math.isfinite(score) and score > 5


def test_quantile_edges_split_the_reference_evenly() -> None:
    ref = list(range(1, 101))
    edges = quantile_edges(ref, 4)
    assert edges.tolist() == pytest.approx([25.75, 50.5, 75.25])
    assert bin_counts(ref, edges).tolist() == [25, 25, 25, 25]
    # Values on an edge fall in the bin below it; beyond the ends, in the outer bins.
    assert bin_counts([25.75, -5, 1000], edges).tolist() == [2, 0, 0, 1]


def test_a_constant_reference_still_separates_a_shift() -> None:
    edges = quantile_edges([7.0] * 50, 10)
    assert edges.tolist() == [7.0]
    assert numeric_psi([7.0] * 50, [7.0] * 50) == 0.0
    assert numeric_psi([7.0] * 50, [300.0] * 50) > 1.0


def test_bins_follow_the_sample_size() -> None:
    assert numeric_bins(10) == 2
    assert numeric_bins(100) == 4
    assert numeric_bins(10_000) == 10


def test_same_distribution_stays_low_a_shift_crosses() -> None:
    rng = random.Random(0)
    ref = [rng.gauss(20, 5) for _ in range(500)]
    same = [rng.gauss(20, 5) for _ in range(500)]
    shifted = [rng.gauss(35, 5) for _ in range(500)]
    assert numeric_psi(ref, same) < 0.1
    assert numeric_psi(ref, shifted) > 0.25


def test_categorical_psi_counts_new_categories() -> None:
    ref = ["latin"] * 95 + ["cyrillic"] * 5
    assert categorical_psi(ref, ["latin"] * 94 + ["cyrillic"] * 6) < 0.05
    assert categorical_psi(ref, ["latin"] * 20 + ["han"] * 80) > 1.0
    with pytest.raises(ValueError, match="both samples"):
        categorical_psi(ref, [])


def test_cosine_distance() -> None:
    assert cosine_distance([1, 0], [2, 0]) == pytest.approx(0.0)
    assert cosine_distance([1, 0], [0, 3]) == pytest.approx(1.0)
    assert cosine_distance([0, 0], [1, 0]) == 1.0
    with pytest.raises(ValueError, match="different lengths"):
        cosine_distance([1, 0], [1, 0, 0])


def test_summaries() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0], numeric=True).as_dict()
    assert s == {"count": 4, "mean": 2.5, "p50": 2.5, "p90": 3.7}
    c = summarize(["a", "b", "a", "a"], numeric=False).as_dict()
    assert c == {"count": 4, "shares": {"a": 0.75, "b": 0.25}}
    assert summarize([], numeric=True).as_dict() == {"count": 0, "mean": None, "p50": None,
                                                     "p90": None}


@pytest.mark.parametrize(("text", "script"), [
    ("What is the capital of France?", "latin"),
    ("Quelle est la capitale de la Françe ?", "latin"),
    ("Какая столица Франции?", "cyrillic"),
    ("<|im_start|>user\nПривет<|im_end|>\n<|im_start|>assistant\n", "cyrillic"),
    ("法国的首都是哪里？", "han"),
    ("ما هي عاصمة فرنسا؟", "arabic"),
    ("Ποια είναι η πρωτεύουσα της Γαλλίας;", "greek"),
    ("프랑스의 수도는 어디입니까?", "hangul"),
    ("The word привет means hello in Russian, used daily by many people.", "latin"),
    ("12345 !!!", "none"),
    ("", "none"),
    (None, "none"),
])
def test_prompt_script(text: str | None, script: str) -> None:
    assert prompt_script(text) == script


def test_prompt_script_reads_only_the_end() -> None:
    # The newest message is at the end of a chat prompt; the cost is bounded by TAIL_CHARS.
    english = "Now answer in English please. " * (TAIL_CHARS // 25)
    assert prompt_script("Какая столица Франции? " * 500 + english) == "latin"
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    question = "<|im_start|>user\nКакая столица Франции?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_script(system + question) == "cyrillic"


@pytest.mark.parametrize(("finish", "stop", "kind"), [
    ("length", None, "max_tokens"), ("stop", None, "eos"), ("stop", "###", "stop_string"),
    ("stop", 13, "stop_token"), ("abort", None, "abort"),
])
def test_stop_kind(finish: str, stop: int | str | None, kind: str) -> None:
    assert stop_kind(finish, stop) == kind
