"""Tools in the prompt: the embedded model's template (no tools: a system block, the history
written in SmolLM's format) and an HF template that takes ``tools`` and ``tool_calls``; the
request checks that give each bad tool field its 400."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar

from tokenmill.api.chat import prepare_chat
from tokenmill.api.errors import APIError, validate_body
from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.model_loader.gguf import load_gguf_tokenizer
from tokenmill.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = {"role": "user", "content": "Weather in Paris?"}
HISTORY = [ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
               {"id": "call_2", "type": "function",
                "function": {"name": "get_time", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
           {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]

# A small template in the Hermes/Qwen manner: tools in the system turn, calls in <tool_call>.
HF_TEMPLATE = """{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.role == "tool" %} ({{ message.tool_call_id }}){% endif %}
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class Served:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, tokenizer.vocab_size, 4096

    def compile_grammar(self, params: object) -> None:
        return None  # the grammar is checked here with xgrammar directly


@pytest.fixture(scope="module")
def smol(smollm_path: str) -> Served:
    return Served(load_gguf_tokenizer(smollm_path))


@pytest.fixture(scope="module")
def hf(smol: Served) -> Served:
    tok = smol.tokenizer
    return Served(Tokenizer(tok.backend, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, chat_template=HF_TEMPLATE))


def _prepare(served: Served, parser: str = "auto", **body: Any):
    req = ChatCompletionRequest.model_validate({"messages": [ASK], **body})
    call = prepare_chat(req, served, parser)
    return call, call.engine_prompts[0]["prompt"]


def test_embedded_template_gets_a_system_block(smol: Served) -> None:
    call, prompt = _prepare(smol, tools=[WEATHER, TIME])
    assert prompt.startswith("<|im_start|>system\nYou can call these functions")
    assert json.dumps(WEATHER["function"]) in prompt
    assert "<tool_call>[\n" in prompt  # auto picked SmolLM's own format
    assert "named SmolLM" not in prompt  # our system turn replaced the default one
    assert call.tools is not None and call.tools.parser.name == "smollm"
    assert call.params.structured_outputs is None  # auto: free generation
    # A system message of the client's keeps its text, with the block after it.
    _, prompt = _prepare(smol, tools=[WEATHER],
                         messages=[{"role": "system", "content": "Be brief."}, ASK])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions")


def test_history_written_in_the_parser_format(smol: Served) -> None:
    _, prompt = _prepare(smol, tools=[WEATHER, TIME], messages=HISTORY)
    assert ('<|im_start|>assistant\n<tool_call>[\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}},\n{"name": "get_time", "arguments": {}}\n]</tool_call>'
            '<|im_end|>') in prompt
    # Both results of the turn in one user message.
    assert ("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n"
            "noon\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt
    _, hermes = _prepare(smol, "hermes", tools=[WEATHER, TIME], messages=HISTORY)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time"') in hermes


def test_tool_choice_none_leaves_tools_out(smol: Served) -> None:
    call, prompt = _prepare(smol, tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in prompt and call.tools is None
    # The history is still rendered: the template cannot take None content.
    call, prompt = _prepare(smol, messages=HISTORY)
    assert "<tool_response>" in prompt and call.tools is None


def test_hf_template_gets_tools_and_calls(hf: Served) -> None:
    call, prompt = _prepare(hf, tools=[WEATHER], messages=HISTORY)
    assert prompt.startswith("<|im_start|>system\n" + json.dumps(WEATHER))
    assert "You can call" not in prompt
    # arguments handed to the template as an object, tool messages kept with their id
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<|im_start|>tool (call_1)18 C<|im_end|>" in prompt
    assert call.tools is not None and call.tools.parser.name == "hermes"


@pytest.mark.parametrize("parser", ["smollm", "hermes"])
def test_forced_choice_sets_a_grammar(smol: Served, parser: str) -> None:
    call, prompt = _prepare(smol, parser, tools=[WEATHER, TIME],
                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "call to the function get_time" in prompt
    grammar = call.params.structured_outputs.grammar
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_grammar(grammar)
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    text = call.tools.parser.format_calls([("get_time", {})])
    assert matcher.accept_string(text) and matcher.is_terminated()
    twice = call.tools.parser.format_calls([("get_time", {}), ("get_time", {})])
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    assert not (matcher.accept_string(twice) and matcher.is_terminated())
    call, _ = _prepare(smol, parser, tools=[WEATHER], tool_choice="required")
    assert "get_weather" in call.params.structured_outputs.grammar


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("unknown named function", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "send"}}}, "tool_choice"),
    ("named without tools", {"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("duplicate names", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("parameters not an object schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ("parameters not an object", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": [1]}}]}, "tools"),
    ("properties not schemas", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": 1}}}}]}, "tools"),
    ("schema xgrammar cannot read", {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]}, "tools"),
    ("too many tools", {"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                  for i in range(129)]}, "tools"),
    ("bad function name", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools"),
    ("forced call and response_format", {"tools": [WEATHER], "tool_choice": "required",
                                         "response_format": {"type": "json_object"}},
     "tool_choice"),
    ("tool message without id", {"messages": [ASK, {"role": "tool", "content": "x"}]},
     "messages"),
    ("call arguments not JSON", {"messages": [ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages"),
    ("call without a function", {"messages": [ASK, {"role": "assistant", "content": "",
                                                    "tool_calls": [{"id": "c"}]}]}, "messages"),
]


@pytest.mark.parametrize(("name", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_tool_fields_are_400s(smol: Served, name: str, body: dict[str, Any],
                                  param: str) -> None:
    with pytest.raises(APIError) as e:
        prepare_chat(validate_body({"messages": [ASK], **body}, ChatCompletionRequest), smol)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
