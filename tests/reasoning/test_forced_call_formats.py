"""The grammar of a forced call in the formats whose markup is special tokens: gpt-oss's
harmony (a commentary message to ``functions.NAME``, opened where the prompt leaves the
model) and Mistral's ``[TOOL_CALLS]NAME[ARGS]{...}``; what the grammar lets through is read
back as the call, and special tokens are kept out of the content."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import xgrammar

from tokenmill.api.chat import ChatCall, prepare_chat
from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.reasoning import ReasoningReader, ReasoningSetup
from tokenmill.api.reasoning_harmony import HARMONY
from tokenmill.api.tool_formats import MistralParser
from tokenmill.api.tool_harmony import HarmonyToolParser, harmony_call, harmony_opening
from tokenmill.api.tool_parsers import HermesParser, resolve_parser
from tokenmill.api.tool_special import HiddenTokens
from tokenmill.api.tools import ToolReader
from tokenmill.sampling_params import SamplingParams

FUNCTIONS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]},
             "ping": None}
NAMES = frozenset(FUNCTIONS)
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>",
            "[TOOL_CALLS]", "[ARGS]"]
# gpt-oss's template writes its final answers on a channel; its generation prompt.
GPT_OSS_TEMPLATE = "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
GPT_OSS_PROMPT = "<|start|>user<|message|>Weather?<|end|><|start|>assistant"


def accepts(ebnf: str, text: str) -> bool:
    """Whether the grammar takes ``text`` whole (a vocabulary of single characters plus the
    markers, as a model's special tokens; ``</s>`` the stop token)."""
    vocab = [chr(c) for c in range(32, 127)] + ["\n", *SPECIALS, "</s>"]
    info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf)
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_a_harmony_template_gets_the_harmony_format() -> None:
    assert isinstance(resolve_parser("auto", GPT_OSS_TEMPLATE), HarmonyToolParser)
    # Asked for by name, a format stays what it is.
    assert type(resolve_parser("hermes", GPT_OSS_TEMPLATE)) is HermesParser


@pytest.mark.parametrize("named", [True, False])
def test_the_harmony_grammar_takes_a_harmony_call_and_no_hermes_block(named: bool) -> None:
    parser = resolve_parser("auto", GPT_OSS_TEMPLATE)
    functions = {"get_weather": FUNCTIONS["get_weather"]} if named else FUNCTIONS
    ebnf = parser.forced_grammar(functions, parallel=True, prompt=GPT_OSS_PROMPT)
    call = harmony_call("get_weather", {"city": "Rome"})
    assert call == ('<|channel|>commentary to=functions.get_weather <|constrain|>json'
                    '<|message|>{"city": "Rome"}<|call|>')
    assert accepts(ebnf, call)
    # <|call|> is a stop token of gpt-oss's: the call may end without writing it.
    assert accepts(ebnf, call.removesuffix("<|call|>"))
    assert not accepts(ebnf, HERMES)
    assert not accepts(ebnf, call.replace("commentary", "final"))
    assert not accepts(ebnf, call.replace('"Rome"', "7"))  # the schema holds
    assert not accepts(ebnf, call + harmony_call("get_weather", {"city": "Paris"}))
    assert accepts(ebnf, harmony_call("ping", {})) is not named


@pytest.mark.parametrize(("prompt", "opening"), [
    (GPT_OSS_PROMPT, ""),
    (GPT_OSS_PROMPT + "<|channel|>analysis<|message|>", "<|end|><|start|>assistant"),
    ("<|start|>user<|message|>Weather?<|end|>", "<|start|>assistant"),
])
def test_the_call_opens_where_the_prompt_leaves_the_model(prompt: str, opening: str) -> None:
    assert harmony_opening(prompt) == opening
    ebnf = HarmonyToolParser().forced_grammar(FUNCTIONS, False, prompt)
    call = harmony_call("get_weather", {"city": "Rome"})
    assert accepts(ebnf, opening + call)
    if opening:
        assert not accepts(ebnf, call)


def read(text: str, size: int, inside: bool = False) -> tuple[str, str, list[str], str, str]:
    """``text`` (a gpt-oss output) through the chat's harmony reader and the format's reader,
    fed in pieces of ``size``: reasoning, content, the calls' names, arguments, reason."""
    call = ChatCall(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), [],
                    SamplingParams(), None,  # type: ignore[arg-type]
                    ToolReader(HarmonyToolParser(), NAMES),
                    ReasoningReader(HARMONY, inside=inside, start_ids=None, end_id=None))
    chunks = call.chunks("m", "id", 0)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    reasoning = content = arguments = reason = ""
    names: list[str] = []
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
                arguments += c.function.arguments or ""
    return reasoning, content, names, arguments, reason


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize(("opening", "end"), [("", "<|call|>"), ("", "<|return|>"),
                                              ("<|end|><|start|>assistant", "<|call|>")])
def test_what_the_grammar_lets_through_is_read_as_the_call(size: int, opening: str,
                                                          end: str) -> None:
    # The output as the engine's text has it: the stop token's text after the call.
    text = opening + harmony_call("get_weather", {"city": "Rome"}).removesuffix("<|call|>") \
        + end
    reasoning, content, names, arguments, reason = read(text, size)
    assert (reasoning, content, names, reason) == ("", "", ["get_weather"], "tool_calls")
    assert json.loads(arguments) == {"city": "Rome"}


@pytest.mark.parametrize("parallel", [False, True])
def test_the_mistral_args_grammar(parallel: bool) -> None:
    parser = resolve_parser("auto", "{{ '[TOOL_CALLS]' + c.name + '[ARGS]' + c.arguments }}")
    assert isinstance(parser, MistralParser) and parser.args_form
    one = parser.format_calls([("get_weather", {"city": "Rome"})])
    two = parser.format_calls([("get_weather", {"city": "Rome"}), ("ping", {})])
    assert one == '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
    ebnf = parser.forced_grammar(FUNCTIONS, parallel)
    assert accepts(ebnf, one) and accepts(ebnf, two) is parallel
    assert not accepts(ebnf, '[TOOL_CALLS][{"name": "get_weather", "arguments": '
                             '{"city": "Rome"}}]')
    assert [c.name for c in parser.parse(two, NAMES)[1]] == ["get_weather", "ping"]
    # A template of the list form keeps the list's grammar; by name, the template says.
    listed = resolve_parser("auto", "{{ '[TOOL_CALLS]' + tool_calls | tojson }}")
    assert not listed.args_form  # type: ignore[attr-defined]
    assert accepts(listed.forced_grammar(FUNCTIONS, False),
                   '[TOOL_CALLS][{"name": "ping", "arguments": {}}]')
    assert resolve_parser("mistral", "[TOOL_CALLS]f[ARGS]").args_form  # type: ignore[attr-defined]


def test_a_call_id_before_the_arguments_is_read() -> None:
    text = '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}'
    content, calls = MistralParser().parse(text, NAMES)
    assert content is None and [(c.name, c.arguments) for c in calls] == \
        [("get_weather", '{"city": "Rome"}')]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_special_tokens_are_kept_out_of_the_content(size: int) -> None:
    hidden = HiddenTokens(frozenset({"</s>", "[INST]", "[TOOL_CALLS]", "[ARGS]"}))
    reader = ToolReader(MistralParser(), NAMES, hidden=hidden)
    text = 'Let me see.[INST]</s>'
    message, _ = reader.message(text, "stop")
    assert message.content == "Let me see." and message.tool_calls is None
    called, reason = reader.message(
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}</s>', "stop")
    assert called.content == "Sure." and reason == "tool_calls"
    assert [c.function.name for c in called.tool_calls or []] == ["get_weather"]
    streamed = ""
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        delta, _ = reader.delta(0, piece, i == len(pieces) - 1, None)
        streamed += delta.content or "" if delta is not None else ""
    assert streamed == "Let me see."


def served(tmp_path: Path, kind: str) -> Any:
    """What prepare_chat needs of a served model, with ``kind``'s tokenizer."""
    from format_models import KINDS, write_byte_tokenizer

    from tokenmill.tokenizer import Tokenizer

    specials, template, eos, bos, leave_out = KINDS[kind]
    tmp_path.mkdir(exist_ok=True)
    write_byte_tokenizer(tmp_path, specials, template, eos, bos, leave_out)
    return SimpleNamespace(tokenizer=Tokenizer.from_hf_dir(str(tmp_path)), max_model_len=512,
                           vocab_size=272, compile_grammar=lambda params: None)


def prepare(model: Any, reasoning: str = "auto", **body: Any) -> ChatCall:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], **body)
    return prepare_chat(req, model, "auto", ReasoningSetup(parser=reasoning))


def test_gpt_oss_without_its_reasoning_parser_is_forced_in_hermes(tmp_path: Path) -> None:
    model = served(tmp_path, "harmony")
    body = {"tools": [{"type": "function", "function": {"name": "ping"}}],
            "tool_choice": "required"}
    grammar = prepare(model, **body).params.structured_outputs.grammar  # type: ignore[union-attr]
    assert "commentary to=functions.ping" in grammar and "<tool_call>" not in grammar
    # --reasoning-parser none: nothing reads harmony's markup, so the call is Hermes's text.
    call = prepare(model, reasoning="none", **body)
    assert "<tool_call>" in call.params.structured_outputs.grammar  # type: ignore[union-attr]
    assert type(call.tools.parser) is HermesParser  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["mistral", "llama3"])
def test_special_tokens_are_kept_only_for_a_request_read_for_calls(tmp_path: Path,
                                                                   kind: str) -> None:
    model = served(tmp_path, kind)
    tools = [{"type": "function", "function": {"name": "ping"}}]
    call = prepare(model, tools=tools)
    assert not call.params.skip_special_tokens and call.tools is not None
    assert call.tools.hidden is not None
    for body in ({}, {"tools": tools, "tool_choice": "none"}):
        assert prepare(model, **body).params.skip_special_tokens
    asked = prepare(model, tools=tools, skip_special_tokens=False)
    assert asked.tools is not None and asked.tools.hidden is None
    # The other formats keep the request's setting.
    assert prepare(served(tmp_path / "coder", "qwen3_coder"), tools=tools).params \
        .skip_special_tokens
