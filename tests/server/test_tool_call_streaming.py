"""Streamed tool calls through the official `openai` client: a call's arguments arrive in
pieces as they are generated, in vLLM's deltas (the first has the index, id, type and name with
arguments "", the next ones only the index and a piece of the arguments), and the pieces add
up to the non-streamed call. Forced calls (named, required) and auto, in SmolLM's format (the
embedded model's) and Hermes'; a plain request after them is answered as before."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import openai
import pytest
from server_harness import Server, start_server

from tokenmill.api.tool_grammar import tool_call_grammar
from tokenmill.api.tool_parsers import PARSERS

NOTE_PARAMS = {"type": "object",
               "properties": {"title": {"type": "string", "maxLength": 20},
                              "text": {"type": "string", "minLength": 60, "maxLength": 120}},
               "required": ["title", "text"]}
NOTE = {"type": "function", "function": {"name": "save_note", "description": "Save a note",
                                         "parameters": NOTE_PARAMS}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
TOOLS = [NOTE, WEATHER]
ASK = [{"role": "user", "content": "Save a note: meet Anna on Friday at ten to plan the "
                                   "budget for next year, and bring the sales figures."}]
NAMED = {"type": "function", "function": {"name": "save_note"}}


@pytest.fixture(scope="module", params=["smollm", "hermes"])
def setup(request: pytest.FixtureRequest, server: Server) -> Iterator[tuple[Server, str]]:
    """The shared server (SmolLM's format, the embedded model's own), and one that writes
    Hermes' format."""
    if request.param == "smollm":
        yield server, "smollm"
        return
    hermes = start_server("--tool-call-parser", "hermes")
    yield hermes, "hermes"
    assert hermes.stop() == 0, hermes.log()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _collect(chunks: Iterable[Any]) -> tuple[list[tuple[str, str]], list[int], str | None]:
    """The streamed calls as (name, arguments), how many argument pieces each came in, and
    the finish reason; checks each delta's shape on the way."""
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            assert "<tool_call>" not in (choice.delta.content or "")
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # the first: id, type, name, arguments ""
                    assert d.id.startswith("call_") and d.type == "function", d
                    assert d.function.name and d.function.arguments == "", d
                    calls[d.index] = {"name": d.function.name, "pieces": []}
                else:  # the next ones: a piece of the arguments only
                    assert d.id is None and d.type is None and d.function.name is None, d
                    assert d.function.arguments, d
                    calls[d.index]["pieces"].append(d.function.arguments)
    assert sorted(calls) == list(range(len(calls)))
    done = [calls[i] for i in sorted(calls)]
    return ([(c["name"], "".join(c["pieces"])) for c in done], [len(c["pieces"]) for c in done],
            reason)


def _check_streamed(server: Server, **kwargs: Any) -> list[int]:
    """The streamed calls equal the whole answer's; the number of pieces of each call."""
    client = _client(server)
    whole = client.chat.completions.create(model=server.model, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    for call in whole.message.tool_calls:
        json.loads(call.function.arguments)
    calls, pieces, reason = _collect(
        client.chat.completions.create(model=server.model, stream=True, **kwargs))
    assert calls == expected and reason == "tool_calls"
    # The SDK's own accumulation agrees.
    with client.chat.completions.stream(model=server.model, **kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        expected
    return pieces


def _plain_request_works(server: Server) -> None:
    client = _client(server)
    out = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=8,
                                         temperature=0)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=server.model, messages=ASK, max_tokens=8, temperature=0, stream=True)
        if c.choices)
    assert text == out.choices[0].message.content


def test_a_named_call_streams_its_arguments(setup: tuple[Server, str]) -> None:
    server, _ = setup
    pieces = _check_streamed(server, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                             max_tokens=200, temperature=0)
    assert len(pieces) == 1 and pieces[0] > 10, pieces  # a long argument: many pieces
    _plain_request_works(server)


def test_required_calls_stream_their_arguments(setup: tuple[Server, str]) -> None:
    server, _ = setup
    pieces = _check_streamed(server, messages=ASK, tools=TOOLS, tool_choice="required",
                             max_tokens=200, temperature=0)
    assert all(n > 1 for n in pieces), pieces


def test_auto_calls_stream_their_arguments(setup: tuple[Server, str]) -> None:
    """With tool_choice auto the model's own text is read: a grammar (vLLM's structured
    outputs) makes the tiny model write a call in the server's format."""
    server, fmt = setup
    grammar = tool_call_grammar(PARSERS[fmt].format, {"save_note": NOTE_PARAMS}, False)
    pieces = _check_streamed(server, messages=ASK, tools=TOOLS, tool_choice="auto",
                             max_tokens=200, temperature=0,
                             extra_body={"structured_outputs": {"grammar": grammar}})
    assert pieces[0] > 10, pieces
    _plain_request_works(server)


def test_the_wire_leaves_out_what_a_later_delta_does_not_carry(
        setup: tuple[Server, str]) -> None:
    """vLLM sends no "id", "type" or "name" after a call's first delta (some clients append
    a null name to the name)."""
    server, _ = setup
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 200,
            "temperature": 0, "stream": True}
    deltas = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    deltas += choice["delta"].get("tool_calls") or []
    assert deltas[0].keys() == {"index", "id", "type", "function"}
    assert deltas[0]["function"].keys() == {"name", "arguments"}
    assert len(deltas) > 2
    for d in deltas[1:]:
        assert d == {"index": 0, "function": {"arguments": d["function"]["arguments"]}}, d
