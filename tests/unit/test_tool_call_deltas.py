"""ToolReader's streamed deltas: arguments in pieces as they come (vLLM's shape) for the chat
stream, or each call whole once its block has ended (Ollama's stream, the Responses API)."""

from __future__ import annotations

import json

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
