"""gpt-oss's harmony format: the analysis channel is the thinking, the final channel the
answer; parsed whole and streamed, and through the engine with a thinking budget (the forced
ending is harmony's ``<|end|><|start|>assistant<|channel|>final<|message|>``)."""

from __future__ import annotations

import random

import httpx
import pytest
from test_reasoning_server import stream
from thinking_model import Server

from tokenmill.api.reasoning import resolve_reasoning_parser
from tokenmill.api.reasoning_harmony import HARMONY
from tokenmill.runner.thinking import ThinkingTracker
from tokenmill.sampling_params import ThinkingBudget

ANSWER = ("<|channel|>analysis<|message|>User asks 2+2.<|end|>"
          "<|start|>assistant<|channel|>commentary<|message|>Let me answer.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>")


def test_split() -> None:
    # A commentary preamble is part of the answer.
    assert HARMONY.split(ANSWER, False) == ("User asks 2+2.", "Let me answer.It is 4.")


@pytest.mark.parametrize("seed", range(20))
def test_streamed_pieces_add_up_to_the_whole_split(seed: int) -> None:
    text = ("<|channel|>analysis<|message|>Think <|channel|> hard.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Four.<|return|>")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 15)))
    stream_ = HARMONY.stream(False)
    reasoning = content = ""
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = stream_.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream_.finish()
    assert (reasoning + r, content + c) == ("Think <|channel|> hard.", "Four.")


def test_auto_picks_harmony_by_the_template() -> None:
    assert resolve_reasoning_parser("auto", "<|start|>assistant<|channel|>final") is HARMONY
    assert resolve_reasoning_parser("gpt_oss", None) is HARMONY


def test_a_start_marker_of_several_tokens_opens_the_budget() -> None:
    budget = ThinkingBudget(2, start_token_ids=(7, 8, 9), end_token_id=4,
                            end_token_ids=(4, 1, 8), starts_inside=False)
    tracker, ids = ThinkingTracker(budget, 1), [0]
    for token in [7, 8, 9, 5, 5, 5, 5, 5, 5]:
        forced = tracker.forced_token(ids)
        ids.append(token if forced is None else forced)
    assert ids[1:] == [7, 8, 9, 5, 5, 4, 1, 8, 5]


def chat(server: Server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "harmony", "messages": [{"role": "user", "content": "t7 t9"}],
        "temperature": 0, "logit_bias": {"5": 100.0}, **body})


def test_the_budget_ends_the_analysis_and_the_final_answer_follows(server: Server) -> None:
    body = chat(server, max_tokens=11, thinking_token_budget=3, reasoning_effort="high").json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"].split() == ["t5"] * 3
    # 11 tokens: 3 of analysis, 6 forced (<|end|> <|start|> assistant <|channel|> final
    # <|message|>), 2 of answer; no markup left in the text.
    assert message["content"].split() == ["t5"] * 2
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    deltas, _ = stream(server, model="harmony", max_tokens=11, thinking_token_budget=3)
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "days": 2}<|call|>')


@pytest.mark.parametrize("size", [1, 4, 9, 500])
def test_a_call_to_a_function_is_read_as_a_tool_call(size: int) -> None:
    import json
    from types import SimpleNamespace

    from tokenmill.api.chat import ChatCall
    from tokenmill.api.protocol import ChatCompletionRequest
    from tokenmill.api.reasoning import ReasoningReader
    from tokenmill.api.tool_parsers import HermesParser
    from tokenmill.api.tools import ToolReader
    from tokenmill.sampling_params import SamplingParams

    call = ChatCall(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), [],
                    SamplingParams(), None,  # type: ignore[arg-type]
                    ToolReader(HermesParser(), frozenset({"get_weather"})),
                    ReasoningReader(HARMONY, inside=False, start_ids=None, end_id=None))
    chunks = call.chunks("m", "id", 0)
    pieces = [CALL[i:i + size] for i in range(0, len(CALL), size)]
    reasoning, arguments, names, content, reason = "", [], [], "", None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = SimpleNamespace(outputs=[SimpleNamespace(
            index=0, text=piece, token_ids=[7], finished=last,
            finish_reason="stop" if last else None, stop_reason=None, logprobs=None)])
        chunk = chunks.delta(0, out)  # type: ignore[arg-type]
        for choice in chunk.choices if chunk is not None else []:
            reasoning += choice.delta.reasoning_content or ""
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for c in choice.delta.tool_calls or []:
                names += [c.function.name] if c.function.name else []
                arguments += [c.function.arguments] if c.function.arguments else []
    assert reasoning == "Need the weather." and content == "" and reason == "tool_calls"
    assert names == ["get_weather"]
    assert json.loads("".join(arguments)) == {"city": "Paris", "days": 2}
    if size < 10:
        assert len(arguments) > 1  # streamed as generated
