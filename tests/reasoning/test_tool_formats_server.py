"""Tool-call formats end to end, on tiny random models whose byte-level tokenizers carry the
format's markup and chat template (tests/reasoning/format_models.py): a gpt-oss (harmony)
model forced to call writes harmony's commentary call, never Hermes's ``<tool_call>``; a
Mistral model's ``[TOOL_CALLS]NAME[ARGS]{...}`` and a Llama 3 call after its text and
``<|python_tag|>`` are read though their tags are special tokens, which the content never
shows; Qwen3-Coder's and Llama 3's forced calls come back as calls, whole and streamed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from format_models import make_format_model
from thinking_model import Server, start_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Served name -> the format (tests/reasoning/format_models.py).
MODELS = {"gptoss": "harmony", "mistral": "mistral", "llama": "llama3",
          "coder": "qwen3_coder"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The models' folders: gptoss/ and mistral/."""
    path = tmp_path_factory.mktemp("formats")
    for name, kind in MODELS.items():
        make_format_model(path / name, kind)
    return path


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Server]:
    models = [arg for name in MODELS for arg in ("--model", f"{name}={root / name}")]
    s = start_server(*models, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    yield s
    assert s.stop() == 0, s.log()


def chat(server: Server, model: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": ASK, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: Server, model: str, **body: Any) -> list[dict[str, Any]]:
    """The streamed chunks' choices."""
    choices = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": model, "messages": ASK, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[6:])["choices"]
    return choices


def streamed_calls(choices: list[dict[str, Any]]) -> tuple[str, list[str], str]:
    """Content, the calls' names and their arguments, added up from the deltas."""
    content, names, arguments = "", [], ""
    for c in choices:
        content += c["delta"].get("content") or ""
        for call in c["delta"].get("tool_calls") or []:
            names += [call["function"]["name"]] if call["function"].get("name") else []
            arguments += call["function"].get("arguments") or ""
    return content, names, arguments


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_on_gpt_oss_is_written_in_harmony(server: Server, choice: Any) -> None:
    body = chat(server, "gptoss", tools=TOOLS, tool_choice=choice, max_tokens=120,
                logprobs=True)
    choice0 = body["choices"][0]
    written = "".join(t["token"] for t in choice0["logprobs"]["content"])
    # What the model wrote is harmony's call, not a Hermes block.
    assert written.startswith("<|channel|>commentary to=functions."), written
    assert "<tool_call>" not in written
    message = choice0["message"]
    assert choice0["finish_reason"] == "tool_calls", written
    assert message["content"] is None and message.get("reasoning_content") is None
    (call,) = message["tool_calls"]
    if choice == NAMED:
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    assert written.startswith(f"<|channel|>commentary to=functions.{call['function']['name']} ")
    content, names, arguments = streamed_calls(stream(server, "gptoss", tools=TOOLS,
                                                      tool_choice=choice, max_tokens=120))
    assert content == "" and names == [call["function"]["name"]]
    assert json.loads(arguments) == json.loads(call["function"]["arguments"])


def test_gpt_oss_without_a_forced_call_is_answered_as_before(server: Server) -> None:
    body = chat(server, "gptoss", max_tokens=6)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 6


def test_a_forced_mistral_call_with_args_is_read(server: Server) -> None:
    body = chat(server, "mistral", tools=TOOLS, tool_choice=NAMED, max_tokens=60)
    choice0 = body["choices"][0]
    message = choice0["message"]
    assert message["content"] is None, message
    assert choice0["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    assert len(call["id"]) == 9  # Mistral's ids
    content, names, arguments = streamed_calls(stream(server, "mistral", tools=TOOLS,
                                                      tool_choice=NAMED, max_tokens=60))
    assert content == "" and names == ["get_weather"]
    assert json.loads(arguments) == json.loads(call["function"]["arguments"])


def test_the_content_shows_no_special_tokens(server: Server, root: Path) -> None:
    from tokenizers import Tokenizer

    inst = Tokenizer.from_file(str(root / "mistral" / "tokenizer.json")).token_to_id("[INST]")
    bias = {"logit_bias": {str(inst): 100.0}, "max_tokens": 3}
    # With tools, special tokens stay in the text for the reader, out of the content.
    body = chat(server, "mistral", tools=TOOLS, tool_choice="auto", **bias)
    assert body["choices"][0]["message"]["content"] == ""
    assert body["choices"][0]["finish_reason"] == "length"
    content, names, _ = streamed_calls(stream(server, "mistral", tools=TOOLS, **bias))
    assert content == "" and names == []
    # A request that asks for special tokens sees them; one without tools is as before.
    shown = chat(server, "mistral", tools=TOOLS, skip_special_tokens=False, **bias)
    assert shown["choices"][0]["message"]["content"] == "[INST]" * 3
    assert chat(server, "mistral", **bias)["choices"][0]["message"]["content"] == ""


# The model's text, forced by a grammar: an answer, then Llama 3's tag and a call.
LLAMA_TEXT = "root ::= " + " ".join(json.dumps(part) for part in (
    "Sure.", "<|python_tag|>", '{"name": "ping", "parameters": {}}'))


def test_a_llama3_call_after_text_and_the_python_tag_is_read(server: Server) -> None:
    # The tag is a special token (the vocabulary has no plain "|"): without it kept in the
    # text, the call would read as content after "Sure.".
    body = chat(server, "llama", tools=TOOLS, max_tokens=60,
                structured_outputs={"grammar": LLAMA_TEXT})
    choice0 = body["choices"][0]
    assert choice0["message"]["content"] == "Sure.", choice0
    assert choice0["finish_reason"] == "tool_calls"
    (call,) = choice0["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("ping", "{}")
    content, names, arguments = streamed_calls(stream(
        server, "llama", tools=TOOLS, max_tokens=60, structured_outputs={"grammar": LLAMA_TEXT}))
    assert (content, names, json.loads(arguments)) == ("Sure.", ["ping"], {})
    # Without tools the same text is content, the tag dropped as before.
    plain = chat(server, "llama", max_tokens=60, structured_outputs={"grammar": LLAMA_TEXT})
    assert plain["choices"][0]["message"]["content"] == 'Sure.{"name": "ping", "parameters": {}}'


@pytest.mark.parametrize(("model", "function"), [("llama", "get_weather"), ("coder", "ping")])
def test_forced_calls_in_the_other_formats(server: Server, model: str, function: str) -> None:
    named = {"type": "function", "function": {"name": function}}
    body = chat(server, model, tools=TOOLS, tool_choice=named, max_tokens=80)
    choice0 = body["choices"][0]
    assert choice0["finish_reason"] == "tool_calls", choice0
    assert choice0["message"]["content"] is None
    (call,) = choice0["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == function
    assert arguments == {} if function == "ping" else arguments["city"] in ("Paris", "Rome")
    content, names, streamed = streamed_calls(stream(server, model, tools=TOOLS,
                                                     tool_choice=named, max_tokens=80))
    assert (content, names, json.loads(streamed)) == ("", [function], arguments)
