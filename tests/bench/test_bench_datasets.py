"""Workloads: exact prompt lengths, length ranges, JSONL files."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest

from tokenmill.bench.codec import LocalCodec
from tokenmill.bench.datasets import (
    SampleRequest,
    fit_prompt,
    load_jsonl,
    parse_len,
    random_requests,
    write_jsonl,
)


class CharCodec:
    """One token per character: the length of any text is easy to check."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def codec() -> LocalCodec:
    """The embedded model's own tokenizer."""
    return LocalCodec()


def test_parse_len() -> None:
    assert parse_len("128", "input_len") == (128, 128)
    assert parse_len(64, "input_len") == (64, 64)
    assert parse_len("100:1024", "input_len") == (100, 1024)
    for bad in ("0", "10:5", "a", "1:b", "-3"):
        with pytest.raises(ValueError, match="input_len"):
            parse_len(bad, "input_len")


@pytest.mark.parametrize("n", [1, 7, 128, 500])
def test_fit_prompt_is_exact_in_the_real_tokenizer(codec: LocalCodec, n: int) -> None:
    text, ids = fit_prompt(codec, n, random.Random(n))
    assert len(ids) == n
    assert codec.encode(text) == ids  # the text the server receives has that length


def test_random_requests_are_seeded_and_within_ranges() -> None:
    a = random_requests(CharCodec(), 20, "10:30", "5:9", seed=3)
    b = random_requests(CharCodec(), 20, "10:30", "5:9", seed=3)
    c = random_requests(CharCodec(), 20, "10:30", "5:9", seed=4)
    assert [r.prompt for r in a] == [r.prompt for r in b] != [r.prompt for r in c]
    for r in a:
        assert 10 <= r.prompt_len <= 30 and len(str(r.prompt)) == r.prompt_len
        assert 5 <= r.output_len <= 9
    assert len({r.prompt_len for r in a}) > 1  # the range is used, not one length


def test_random_requests_need_one_prompt() -> None:
    with pytest.raises(ValueError, match="num_prompts"):
        random_requests(CharCodec(), 0, "8", "8", seed=0)


def test_jsonl_round_trip_and_repeat(tmp_path) -> None:
    path = str(tmp_path / "w.jsonl")
    rows = [SampleRequest("hello there", 11, 4), SampleRequest([5, 6, 7], 3, 2)]
    write_jsonl(path, rows)
    back = load_jsonl(path, None, "16", seed=0, codec=None)
    assert back == rows
    assert [r.prompt for r in load_jsonl(path, 3, "16", 0, None)] == ["hello there", [5, 6, 7],
                                                                      "hello there"]


def test_jsonl_fills_missing_lengths(tmp_path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "abcd"}) + "\n\n" + json.dumps(
        {"prompt_token_ids": [1, 2], "output_len": 3}) + "\n")
    a, b = load_jsonl(str(path), None, "7", seed=0, codec=CharCodec())
    assert (a.prompt_len, a.output_len) == (4, 7)
    assert (b.prompt_len, b.output_len) == (2, 3)
    with pytest.raises(ValueError, match="tokenizer"):
        load_jsonl(str(path), None, "7", seed=0, codec=None)


@pytest.mark.parametrize("line", ['{"text": "x"}', '{"prompt": ""}', '{"prompt": "x", '
                                  '"output_len": 0}', '[1, 2]'])
def test_jsonl_rejects_bad_rows(tmp_path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl(str(path), None, "8", seed=0, codec=CharCodec())
