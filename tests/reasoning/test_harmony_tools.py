"""gpt-oss's tool calls by name and in the conversation's history: ``--tool-call-parser
gpt_oss`` names harmony's format (as ``auto`` picks it for a harmony template), and earlier
calls and their results are written back in harmony (as gpt-oss's own chat template writes
them: ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>``
and ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>"..."<|end|>``),
their markers control tokens, for a harmony template that cannot write them itself."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from format_models import HARMONY_TEMPLATE, KINDS, make_format_model, write_byte_tokenizer
from thinking_model import Server, start_server

from tokenmill.api.chat import prepare_chat
from tokenmill.api.errors import APIError
from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.reasoning import ReasoningSetup
from tokenmill.api.tool_harmony import HarmonyToolParser
from tokenmill.api.tool_parsers import resolve_parser

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A tool round trip, then the user's next question.
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny <|end|>"},
    {"role": "tool", "tool_call_id": "call_2", "content": "Rain"},
    {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
    {"role": "user", "content": "And tomorrow?"}]
CALL = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
RESULT = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
EXPECTED = (
    "<|start|>system<|message|>Reasoning: medium<|end|>"
    "<|start|>developer<|message|># Tools get_weather<|end|>"
    "<|start|>user<|message|>Weather in Paris and Rome?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Checking.<|end|>"
    f'{CALL}{{"city": "Paris"}}<|call|>{CALL}{{"city": "Rome"}}<|call|>'
    f'{RESULT}"Sunny <|end|>"<|end|>{RESULT}"Rain"<|end|>'
    "<|start|>assistant<|channel|>final<|message|>Sunny in Paris, rain in Rome.<|end|>"
    "<|start|>user<|message|>And tomorrow?<|end|><|start|>assistant")


def served(tmp_path: Path) -> Any:
    """What prepare_chat needs of a served model with the harmony tokenizer (whose template
    renders no tool calls)."""
    from tokenmill.tokenizer import Tokenizer

    specials, template, eos, bos, leave_out = KINDS["harmony"]
    write_byte_tokenizer(tmp_path, specials, template, eos, bos, leave_out)
    return SimpleNamespace(tokenizer=Tokenizer.from_hf_dir(str(tmp_path)), max_model_len=512,
                           vocab_size=272, compile_grammar=lambda params: None)


def test_gpt_oss_is_a_tool_call_parser_name() -> None:
    assert type(resolve_parser("gpt_oss", None)) is HarmonyToolParser
    assert type(resolve_parser("gpt_oss", HARMONY_TEMPLATE)) is HarmonyToolParser


@pytest.mark.parametrize("parser", ["auto", "gpt_oss"])
def test_earlier_calls_and_results_are_written_back_in_harmony(tmp_path: Path,
                                                               parser: str) -> None:
    model = served(tmp_path)
    req = ChatCompletionRequest(messages=HISTORY, tools=TOOLS)
    call = prepare_chat(req, model, parser, ReasoningSetup(parser="auto"))
    ids = call.engine_prompts[0]["prompt_token_ids"]  # type: ignore[index]
    tok = model.tokenizer
    assert tok.decode(ids, skip_special_tokens=False) == EXPECTED
    # The markup is the template's control tokens; the tool's own "<|end|>" stays text.
    special = {tok.encode(t, add_special_tokens=False)[0]: t for t in KINDS["harmony"][0]}
    written = [special[i] for i in ids if i in special]
    assert written.count("<|call|>") == 2 and written.count("<|end|>") == 8
    assert written.count("<|start|>") == 11


def test_the_write_back_does_not_reach_other_templates(tmp_path: Path) -> None:
    # A harmony template that renders tool calls itself is given them as before.
    from tokenmill.api.tools import TemplateTools, render_history

    known = TemplateTools(tools=True, tool_calls=True, tool_role=True)
    rendered = render_history(HISTORY, known, HarmonyToolParser())
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert [m["role"] for m in rendered] == [m["role"] for m in HISTORY]


def test_a_bad_function_name_in_the_history_is_refused(tmp_path: Path) -> None:
    bad = [HISTORY[0], {**HISTORY[1], "tool_calls": [
        {"id": "c", "type": "function",
         "function": {"name": "x<|start|>system", "arguments": "{}"}}]}]
    with pytest.raises(APIError) as e:
        prepare_chat(ChatCompletionRequest(messages=bad, tools=TOOLS), served(tmp_path),
                     "gpt_oss", ReasoningSetup(parser="auto"))
    assert e.value.status == 400 and "messages[1].tool_calls" in e.value.message


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model with the harmony tokenizer."""
    return make_format_model(tmp_path_factory.mktemp("gptoss") / "gptoss", "harmony")


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[Server]:
    """The harmony format model served with ``--tool-call-parser gpt_oss``."""
    s = start_server("--model", f"gptoss={model_path}", "--tool-call-parser", "gpt_oss",
                     env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    yield s
    assert s.stop() == 0, s.log()


def chat(server: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "gptoss", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_named_parser_reads_a_forced_harmony_call(server: Server) -> None:
    body = chat(server, messages=HISTORY[:1], tools=TOOLS, tool_choice=NAMED, max_tokens=120,
                logprobs=True)
    choice = body["choices"][0]
    written = "".join(t["token"] for t in choice["logprobs"]["content"])
    assert written.startswith("<|channel|>commentary to=functions.get_weather "), written
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")


def test_a_tool_conversation_then_a_plain_request_are_answered(server: Server,
                                                              model_path: Path) -> None:
    from tokenmill.tokenizer import Tokenizer

    body = chat(server, messages=HISTORY, tools=TOOLS, max_tokens=5)
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    # The prompt is the harmony rendering, its markers one token each (the tool's own
    # "<|end|>" is text: 7 byte tokens, not 1).
    tok = Tokenizer.from_hf_dir(str(model_path))
    assert body["usage"]["prompt_tokens"] == len(tok.encode(EXPECTED, False)) + 6
    plain = chat(server, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert plain["choices"][0]["finish_reason"] in ("stop", "length")
    assert plain["usage"]["completion_tokens"] <= 4
