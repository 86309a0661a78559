"""ToolReader's streamed deltas: arguments in pieces as they come (vLLM's shape) for the chat
stream, or each call whole once its block has ended (Ollama's stream, the Responses API)."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.api.tool_parsers import HermesParser, SmolLMParser, ToolParser
from tokenmill.api.tools import ToolReader

NAMES = frozenset({"save_note", "get_weather"})
CALLS = [("save_note", {"title": "Budget", "text": "Meet Anna on Friday at ten, bring the "
                                                   "sales figures \u2713 and the \"plan\"."}),
         ("get_weather", {"city": "Paris"})]


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("parser", [HermesParser(), SmolLMParser()], ids=["hermes", "smollm"])
def test_arguments_stream_in_pieces(parser: ToolParser) -> None:
    text = "Sure.\n" + parser.format_calls(CALLS)
    reader = ToolReader(parser, NAMES)
    whole, _ = reader.message(text, "stop")
    pieces = _pieces(text)
    calls: dict[int, list[str]] = {}
    reasons = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        delta, reason = reader.delta(0, piece, last, "stop" if last else None)
        reasons.append(reason)
        for d in (delta.tool_calls if delta is not None else None) or []:
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function"
                assert d.function.name == CALLS[d.index][0] and d.function.arguments == ""
                calls[d.index] = []
            else:
                assert d.id is None and d.type is None and d.function.name is None
                calls[d.index].append(d.function.arguments)
            # Serialised, a later delta carries only its index and its piece.
            if d.id is None:
                assert json.loads(d.model_dump_json()) == {
                    "index": d.index, "function": {"arguments": d.function.arguments}}
    assert reasons[-1] == "tool_calls"
    assert [json.loads("".join(p)) for p in calls.values()] == [args for _, args in CALLS]
    assert ["".join(p) for p in calls.values()] == \
        [c.function.arguments for c in whole.tool_calls]
    assert len(calls[0]) > 10  # the long argument came in many pieces


@pytest.mark.parametrize("parser", [HermesParser(), SmolLMParser()], ids=["hermes", "smollm"])
def test_whole_calls_once_their_block_ends(parser: ToolParser) -> None:
    text = parser.format_calls(CALLS) + "\nDone."
    reader = ToolReader(parser, NAMES, whole_calls=True)
    seen = []
    for k, piece in enumerate(_pieces(text)):
        delta, _ = reader.delta(0, piece, False, None)
        for d in (delta.tool_calls if delta is not None else None) or []:
            # A call comes whole, and only once the text so far holds its block's end.
            assert d.id.startswith("call_") and d.type == "function"
            fed = "".join(_pieces(text)[:k + 1])
            assert "</tool_call>" in fed[fed.index(d.function.name):]
            seen.append((d.function.name, json.loads(d.function.arguments)))
    assert seen == CALLS


def test_a_cut_off_call_is_given_whole_at_the_end() -> None:
    text = SmolLMParser().format_calls(CALLS)[:60]
    reader = ToolReader(SmolLMParser(), NAMES, whole_calls=True)
    delta, _ = reader.delta(0, text, False, None)
    assert delta is None or not delta.tool_calls
    delta, reason = reader.delta(0, "", True, "length")
    assert reason == "length"
    assert [d.function.name for d in delta.tool_calls] == ["save_note"]
    assert text.endswith(delta.tool_calls[0].function.arguments)


def _random_json(rng: random.Random, depth: int = 0) -> object:
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('ab "\\/\n\t\u00e9\u2713<>{}[],:') for _ in range(rng.randrange(8)))
    if kind == "int":
        return rng.randrange(-10**6, 10**6)
    if kind == "float":
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randrange(-8, 8)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randrange(4))}


@pytest.mark.parametrize("seed", range(30))
def test_random_arguments_in_random_pieces(seed: int) -> None:
    """Whatever the arguments and however the text is split, the pieces add up to the
    arguments as json.dumps writes them, and to the whole answer's."""
    rng = random.Random(seed)
    args = {"a": _random_json(rng), "b": _random_json(rng)}
    parser = rng.choice([HermesParser(), SmolLMParser()])
    text = parser.format_calls([("save_note", args)])
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 40))))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    reader = ToolReader(parser, NAMES)
    streamed = ""
    for k, piece in enumerate(pieces):
        delta, _ = reader.delta(0, piece, k == len(pieces) - 1, "stop")
        for d in (delta.tool_calls if delta is not None else None) or []:
            streamed += d.function.arguments
    whole, reason = ToolReader(parser, NAMES).message(text, "stop")
    assert reason == "tool_calls" and whole.content is None
    assert streamed == whole.tool_calls[0].function.arguments == \
        json.dumps(args, ensure_ascii=False)
