"""A tool call after the thinking is read from the answer, whole and streamed; a call-like
text inside the thinking stays thinking."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tokenmill.api.chat import ChatCall
from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.reasoning import PARSERS, ReasoningReader
from tokenmill.api.response_building import Choice, Collected
from tokenmill.api.tool_parsers import HermesParser
from tokenmill.api.tools import ToolReader
from tokenmill.sampling_params import SamplingParams

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = f"Weather? <tool_call>x</tool_call> so call it.\n</think>\n\n{CALL}"


def make_call() -> ChatCall:
    return ChatCall(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), [],
                    SamplingParams(), None,  # type: ignore[arg-type]
                    ToolReader(HermesParser(), frozenset({"get_weather"})),
                    ReasoningReader(PARSERS["qwen3"], inside=True, start_ids=None, end_id=None))


def test_whole_answer() -> None:
    result = Collected([[Choice([TEXT], 30, [], "stop", None)]], [[1, 2]], [None])
    message = make_call().response(result, "m", "id", 0).choices[0].message
    assert message.reasoning_content == "Weather? <tool_call>x</tool_call> so call it."
    assert message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("size", [1, 3, 7, 100])
def test_streamed_answer(size: int) -> None:
    chunks = make_call().chunks("m", "id", 0)
    pieces = [TEXT[i:i + size] for i in range(0, len(TEXT), size)]
    reasoning, arguments, names = "", "", []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = SimpleNamespace(outputs=[SimpleNamespace(
            index=0, text=piece, token_ids=[7], finished=last,
            finish_reason="stop" if last else None, stop_reason=None, logprobs=None)])
        chunk = chunks.delta(0, out)  # type: ignore[arg-type]
        for choice in chunk.choices if chunk is not None else []:
            d = choice.delta
            reasoning += d.reasoning_content or ""
            assert not d.content
            for call in d.tool_calls or []:
                names += [call.function.name] if call.function.name else []
                arguments += call.function.arguments or ""
            if last:
                assert choice.finish_reason == "tool_calls"
    assert reasoning == "Weather? <tool_call>x</tool_call> so call it."
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
