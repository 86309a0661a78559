"""SamplingParams validation: every bad value raises ValueError naming the field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tokenmill.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    SamplingParams,
)

NAN, INF = math.nan, math.inf

# (field, bad value) pairs: wrong type, bool for a number, NaN, inf, and each side of the range.
BAD_VALUES: list[tuple[str, Any]] = [
    ("n", 0), ("n", MAX_N + 1), ("n", 1.0), ("n", True), ("n", "2"), ("n", None),
    ("temperature", -0.1), ("temperature", 100.5), ("temperature", NAN), ("temperature", INF),
    ("temperature", "1"), ("temperature", True), ("temperature", None),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", NAN), ("top_p", INF),
    ("top_p", False), ("top_p", "0.5"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", 2.0), ("top_k", True), ("top_k", "5"),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", NAN), ("min_p", -INF), ("min_p", True),
    ("seed", -1), ("seed", 2**63), ("seed", 1.0), ("seed", True), ("seed", "1"),
    ("presence_penalty", -2.01), ("presence_penalty", 2.01), ("presence_penalty", NAN),
    ("presence_penalty", INF), ("presence_penalty", True), ("presence_penalty", "0"),
    ("frequency_penalty", -2.01), ("frequency_penalty", 2.01), ("frequency_penalty", NAN),
    ("frequency_penalty", -INF), ("frequency_penalty", False), ("frequency_penalty", [0.1]),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 10.5),
    ("repetition_penalty", NAN), ("repetition_penalty", INF), ("repetition_penalty", True),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 5.0), ("max_tokens", True),
    ("max_tokens", "16"),
    ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", True), ("min_tokens", None),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 1.0), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", MAX_LOGPROBS + 1),
    ("prompt_logprobs", 2.0), ("prompt_logprobs", False),
    ("include_stop_str_in_output", 1), ("ignore_eos", "yes"), ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES,
                         ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_bad_value_names_field(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


# Values right at the edges of each range are accepted.
GOOD_VALUES: list[tuple[str, Any]] = [
    ("n", 1), ("n", MAX_N), ("temperature", 0.0), ("temperature", 100.0), ("temperature", 1),
    ("top_p", 1.0), ("top_p", 1e-6), ("top_k", 0), ("top_k", 100000), ("min_p", 0.0),
    ("min_p", 1.0), ("seed", 0), ("seed", 2**63 - 1), ("presence_penalty", -2.0),
    ("presence_penalty", 2), ("frequency_penalty", -2.0), ("frequency_penalty", 2.0),
    ("repetition_penalty", 1e-3), ("repetition_penalty", 10.0), ("max_tokens", 1),
    ("max_tokens", None), ("min_tokens", 0), ("logprobs", 0), ("logprobs", MAX_LOGPROBS),
    ("prompt_logprobs", 0), ("prompt_logprobs", MAX_LOGPROBS),
]


@pytest.mark.parametrize(("name", "value"), GOOD_VALUES,
                         ids=[f"{n}={v!r}" for n, v in GOOD_VALUES])
def test_edge_values_accepted(name: str, value: Any) -> None:
    assert getattr(SamplingParams(**{name: value}), name) == value


def test_defaults_are_valid() -> None:
    p = SamplingParams()
    p.validate(vocab_size=10)
    assert p.n == 1 and p.temperature == 1.0 and p.top_k == 0 and p.max_tokens == 16
    assert p.stop_strings == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert not p.greedy


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


def test_stop_normalised() -> None:
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop=("a",)).stop_strings == ["a"]


@pytest.mark.parametrize("stop", [
    [""], "", ["ok", ""], [5], ["ok", None], 5, {"a": 1},
    ["x" * (MAX_STOP_STRING_LEN + 1)],
    [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)],
])
def test_bad_stop(stop: Any) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


def test_stop_limits_accepted() -> None:
    SamplingParams(stop=["x" * MAX_STOP_STRING_LEN])
    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])


@pytest.mark.parametrize("ids", [[-1], [1.0], [True], ["3"], 7,
                                 list(range(MAX_STOP_STRINGS + 1))])
def test_bad_stop_token_ids(ids: Any) -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=ids)


def test_stop_token_ids_checked_against_vocab() -> None:
    p = SamplingParams(stop_token_ids=[3, 99])
    p.validate()  # no vocabulary: any non-negative id
    p.validate(vocab_size=100)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 98\]"):
        p.validate(vocab_size=99)


@pytest.mark.parametrize(("bias", "field"), [
    ({-1: 1.0}, "logit_bias key"), ({"5": 1.0}, "logit_bias key"), ({True: 1.0}, "logit_bias key"),
    ({5: 100.5}, r"logit_bias\[5\]"), ({5: -101}, r"logit_bias\[5\]"),
    ({5: NAN}, r"logit_bias\[5\]"), ({5: INF}, r"logit_bias\[5\]"), ({5: "1"}, r"logit_bias\[5\]"),
    ([(5, 1.0)], "logit_bias"), (3, "logit_bias"),
])
def test_bad_logit_bias(bias: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(logit_bias=bias)


def test_logit_bias_checked_against_vocab() -> None:
    p = SamplingParams(logit_bias={0: -100.0, 49: 100.0})
    p.validate(vocab_size=50)
    with pytest.raises(ValueError, match="logit_bias key"):
        p.validate(vocab_size=49)


def test_too_many_logit_bias_entries() -> None:
    SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})


def test_logit_bias_is_copied() -> None:
    bias = {1: 2.0}
    p = SamplingParams(logit_bias=bias)
    bias[2] = 3.0
    assert p.logit_bias == {1: 2.0}


def test_message_names_range() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0\.0, 1\.0\], got 1\.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"temperature must be finite"):
        SamplingParams(temperature=NAN)
    with pytest.raises(ValueError, match=r"n must be an integer, got bool"):
        SamplingParams(n=True)
