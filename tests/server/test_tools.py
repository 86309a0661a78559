"""Tool calling through the official `openai` client: forced calls always parse and validate,
streamed deltas add up to the same call, tool results are accepted back, bad tool fields get
their 400 and the next request is served."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_harness import Server, start_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Reserve a table",
    "parameters": {"type": "object",
                   "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 8},
                                  "names": {"type": "array", "items": {"type": "string",
                                                                       "maxLength": 12},
                                            "minItems": 1, "maxItems": 3},
                                  "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                  "outside": {"type": "boolean"}},
                   "required": ["guests", "names", "time"]}}}
TOOLS = [WEATHER, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and book me a table."}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _valid(call: Any, names: set[str]) -> dict[str, Any]:
    """The call's arguments, checked: a known function and arguments that match its schema."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_named_function_gives_valid_arguments(client: openai.OpenAI, server: Server) -> None:
    for name in SCHEMAS:
        out = client.chat.completions.create(
            model=server.model, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.8,
            seed=7, n=2, tool_choice={"type": "function", "function": {"name": name}})
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None
            assert len(choice.message.tool_calls) == 1
            _valid(choice.message.tool_calls[0], {name})


def test_required_one_call_without_parallel(client: openai.OpenAI, server: Server) -> None:
    out = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _valid(choice.message.tool_calls[0], set(SCHEMAS))


def test_auto_answers_text_or_valid_calls(client: openai.OpenAI, server: Server) -> None:
    """The tiny model seldom calls on its own: whatever it does must be well formed."""
    out = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                         max_tokens=40, temperature=0)
    message = out.choices[0].message
    assert "<tool_call>" not in (message.content or "")
    for call in message.tool_calls or []:
        _valid(call, set(SCHEMAS))
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_deltas_add_up_to_the_same_call(client: openai.OpenAI, server: Server) -> None:
    kwargs: dict[str, Any] = dict(model=server.model, messages=ASK, tools=TOOLS,
                                  tool_choice="required", max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            assert "<tool_call>" not in (choice.delta.content or "")
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    # The SDK's own accumulation agrees.
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


def test_parse_with_a_pydantic_tool(client: openai.OpenAI, server: Server) -> None:
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    out = client.chat.completions.parse(
        model=server.model, messages=ASK, tools=[tool], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    parsed = out.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather)


def test_tool_results_are_accepted_back(client: openai.OpenAI, server: Server) -> None:
    first = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "18 C and sunny"}
                for c in message.tool_calls]
    prompt_tokens = {}
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS,
                                             tool_choice=choice, max_tokens=16, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        prompt_tokens[choice] = out.usage.prompt_tokens
    assert prompt_tokens["auto"] > first.usage.prompt_tokens  # the call and its result added
    assert prompt_tokens["none"] < prompt_tokens["auto"]  # no tools in the prompt
    # Without tools at all, the history still renders.
    out = client.chat.completions.create(model=server.model, messages=history, max_tokens=8)
    assert out.choices[0].message.content is not None


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("unknown named function", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "send_mail"}}}, "tool_choice"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("named without tools", {"tool_choice": {"type": "function",
                                             "function": {"name": "get_weather"}}},
     "tool_choice"),
    ("duplicate tool names", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("parameters of type string", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ("parameters a list", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": ["x"]}}]}, "tools"),
    ("unsupported schema in a forced call", {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]}, "tools"),
    ("too many tools", {"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                  for i in range(129)]}, "tools"),
    ("tool_choice of another type", {"tools": TOOLS, "tool_choice": "sometimes"},
     "tool_choice"),
    ("tool message without tool_call_id", {"messages": [*ASK, {"role": "tool",
                                                               "content": "x"}]}, "messages"),
    ("forced call with response_format", {"tools": TOOLS, "tool_choice": "required",
                                          "response_format": {"type": "json_object"}},
     "tool_choice"),
]


@pytest.mark.parametrize(("name", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_tool_fields_then_the_next_request_works(server: Server, name: str,
                                                     body: dict[str, Any], param: str) -> None:
    url = f"{server.url}/v1/chat/completions"
    r = httpx.post(url, json={"messages": ASK, "max_tokens": 4, **body}, timeout=300)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(url, json={"messages": ASK, "max_tokens": 4, "tools": TOOLS}, timeout=300)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")


def test_hermes_parser_option() -> None:
    """`--tool-call-parser hermes` on the embedded model: Hermes' format, forced and parsed."""
    server = start_server("--tool-call-parser", "hermes")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        kwargs: dict[str, Any] = dict(model=server.model, messages=ASK, tools=TOOLS,
                                      tool_choice="required", max_tokens=120, temperature=0)
        out = client.chat.completions.create(**kwargs).choices[0]
        assert out.finish_reason == "tool_calls"
        for call in out.message.tool_calls:
            _valid(call, set(SCHEMAS))
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        streamed: dict[int, list[str]] = {}
        for d in deltas:  # the name first, then the arguments in pieces
            streamed.setdefault(d.index, []).append(d.function.name or d.function.arguments)
        assert [(p[0], "".join(p[1:])) for _, p in sorted(streamed.items())] == \
            [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    finally:
        assert server.stop() == 0, server.log()
