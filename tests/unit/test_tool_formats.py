"""The tool-call formats beyond Hermes/SmolLM (llama3_json, mistral, qwen3_coder, pythonic):
each read whole and streamed (split at every point and at random points, always the same
answer), arguments streamed in several deltas in vLLM's shape, malformed calls kept as
content, chosen by name or by the chat template, and forced by a grammar the reader reads."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
import torch
import xgrammar

from tokenmill.api.tool_formats import FORMAT_PARSERS
from tokenmill.api.tool_parsers import ParsedCall, ToolParser, assemble, resolve_parser
from tokenmill.api.tools import ToolReader

NAMES = frozenset({"get_weather", "ping", "save"})
SCHEMAS: dict[str, Any] = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
        "ratio": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
        "zip": {"type": "string"}}},
    "ping": None,
    "save": {"type": "object", "properties": {"text": {"type": "string"}}},
}
WEATHER = ParsedCall("get_weather", '{"city": "Paris; FR", "days": 3}')
PING = ParsedCall("ping", "{}")

# Per format: (model output, expected content, expected calls).
CASES: dict[str, list[tuple[str, str | None, list[ParsedCall]]]] = {
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris; FR", "days": 3}}',
         None, [WEATHER]),
        ('Let me look.<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris; FR",'
         ' "days": 3}}; {"name": "ping", "parameters": {}}', "Let me look.", [WEATHER, PING]),
        ('{"type": "function", "name": "ping", "parameters": {}}', None, [PING]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ('{"name": "rm_rf", "parameters": {}}', '{"name": "rm_rf", "parameters": {}}', []),
        ('The call is {"name": "ping", "parameters": {}}',
         'The call is {"name": "ping", "parameters": {}}', []),
        ("Plain answer; nothing to call.", "Plain answer; nothing to call.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris; FR", "days": 3}},'
         ' {"name": "ping", "arguments": {}}]', None, [WEATHER, PING]),
        ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris; FR", "days": 3}'
         '[TOOL_CALLS]ping[ARGS]{}', "Checking.", [WEATHER, PING]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris; FR", "days": 3}}]'
         '[TOOL_CALLS][{"name": "ping", "arguments": {}}]', None, [WEATHER, PING]),
        # The tag is a special token: skipped, the list alone is still read.
        ('[{"name": "ping", "arguments": {}}]', None, [PING]),
        ("[1] Smith, 2019.", "[1] Smith, 2019.", []),
        ("[TOOL_CALLS]unknown[ARGS]{}", "[TOOL_CALLS]unknown[ARGS]{}", []),
        ("[TOOL_CALLS]ping[ARGS]not json", "[TOOL_CALLS]ping[ARGS]not json", []),
    ],
    "qwen3_coder": [
        ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis; FR\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=ping>\n</function>\n</tool_call>", "I will check.",
         [WEATHER, PING]),
        # Typed by the schema: the string "007" stays a string, the rest are parsed.
        ("<tool_call>\n<function=get_weather>\n<parameter=zip>\n007\n</parameter>\n"
         "<parameter=hot>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
         '<parameter=opts>\n{"a": [1, null]}\n</parameter>\n<parameter=tags>\n["x"]\n'
         "</parameter>\n<parameter=days>\nmany\n</parameter>\n<parameter=extra>\n1\n"
         "</parameter>\n</function>\n</tool_call>", None,
         [ParsedCall("get_weather", '{"zip": "007", "hot": true, "ratio": 0.5, "opts": '
                     '{"a": [1, null]}, "tags": ["x"], "days": "many", "extra": "1"}')]),
        ("<tool_call>\n<function=save>\n<parameter=text>\nline one\n<b>two</b>\n</parameter>\n"
         "</function>\n</tool_call>", None,
         [ParsedCall("save", '{"text": "line one\\n<b>two</b>"}')]),
        ("<tool_call>\n<function=nope>\n</function>\n</tool_call> ok",
         "<tool_call>\n<function=nope>\n</function>\n</tool_call> ok", []),
        ("a <tool_call> b", "a <tool_call> b", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris; FR", days=3), ping()]', None, [WEATHER, PING]),
        ("[save(text='it\\'s (a) \"test\", ok'), save(text='''x ''' )]", None,
         [ParsedCall("save", '{"text": "it\'s (a) \\"test\\", ok"}'),
          ParsedCall("save", '{"text": "x "}')]),
        ('[get_weather(opts={"a": (1, True, None)}, tags=["]", ")"], hot=true)]', None,
         [ParsedCall("get_weather", '{"opts": {"a": [1, true, null]}, "tags": ["]", ")"], '
                     '"hot": true}')]),
        ('[get_weather(city=__import__("os").system("x"))]',
         '[get_weather(city=__import__("os").system("x"))]', []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[unknown(a=1)]", "[unknown(a=1)]", []),
        ("Call get_weather(city='x') yourself.", "Call get_weather(city='x') yourself.", []),
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def _streamed(parser: ToolParser, text: str,
              cuts: list[int]) -> tuple[str | None, list[ParsedCall], list[Any]]:
    stream = parser.stream(NAMES, SCHEMAS)
    content, deltas, last = "", [], 0
    for cut in [*cuts, len(text)]:
        events = stream.feed(text[last:cut])
        content, last = content + events.content, cut
        deltas += events.deltas
    events = stream.finish()
    content += events.content
    deltas += events.deltas
    calls = assemble(deltas)
    return (content or None) if calls else content, calls, deltas


@pytest.mark.parametrize(("name", "text", "content", "calls"), ALL)
def test_whole_and_streamed(name: str, text: str, content: str | None,
                            calls: list[ParsedCall]) -> None:
    parser = resolve_parser(name, None)
    assert parser.parse(text, NAMES, SCHEMAS) == (content, calls)
    for arguments in (c.arguments for c in calls):
        json.loads(arguments)
    every = list(range(len(text) + 1))
    assert _streamed(parser, text, every)[:2] == (content, calls)
    rng = random.Random(len(text))
    for _ in range(25):
        cuts = sorted(rng.sample(every, rng.randint(1, min(12, len(every)))))
        assert _streamed(parser, text, cuts)[:2] == (content, calls), cuts


@pytest.mark.parametrize("name", list(FORMAT_PARSERS))
def test_arguments_stream_in_several_deltas(name: str) -> None:
    parser = resolve_parser(name, None)
    args = {"city": "Paris", "days": 3, "hot": False}
    # Llama's JSON and a pythonic list are calls only where the output begins with them.
    intro = "Sure. " if name in ("mistral", "qwen3_coder") else ""
    text = intro + parser.format_calls([("get_weather", args), ("ping", {})])
    reader = ToolReader(parser, NAMES, schemas=SCHEMAS)
    pieces: dict[int, list[str]] = {}
    reason = None
    for k, ch in enumerate(text):
        last = k == len(text) - 1
        delta, reason = reader.delta(0, ch, last, "stop" if last else None)
        for d in (delta.tool_calls if delta is not None else None) or []:
            if d.index not in pieces:  # the first: id, type, name and arguments ""
                assert d.id and d.type == "function" and d.function.name
                assert d.function.arguments == ""
                pieces[d.index] = []
            else:
                assert d.id is None and d.function.name is None
                pieces[d.index].append(d.function.arguments)
    assert reason == "tool_calls"
    assert len(pieces[0]) >= 3  # not one delta at the end
    assert [json.loads("".join(p)) for p in pieces.values()] == [args, {}]
    whole, _ = ToolReader(parser, NAMES, schemas=SCHEMAS).message(text, "stop")
    assert whole.content == (intro.strip() or None)
    assert ["".join(p) for p in pieces.values()] == \
        [c.function.arguments for c in whole.tool_calls]


@pytest.mark.parametrize("name", list(FORMAT_PARSERS))
def test_written_calls_read_back(name: str) -> None:
    parser = resolve_parser(name, None)
    calls = [("get_weather", {"city": "Nice", "days": 2, "tags": ["a", "b"]}), ("ping", {})]
    _, read = parser.parse(parser.format_calls(calls), NAMES, SCHEMAS)
    assert [(c.name, json.loads(c.arguments)) for c in read] == calls


def test_whole_calls_for_ollama() -> None:
    parser = resolve_parser("qwen3_coder", None)
    text = parser.format_calls([("get_weather", {"city": "Oslo"}), ("ping", {})])
    reader = ToolReader(parser, NAMES, whole_calls=True, schemas=SCHEMAS)
    got = []
    for k in range(0, len(text), 5):
        last = k + 5 >= len(text)
        delta, _ = reader.delta(0, text[k:k + 5], last, "stop" if last else None)
        got += (delta.tool_calls if delta is not None else None) or []
    assert [(d.function.name, d.function.arguments) for d in got] == \
        [("get_weather", '{"city": "Oslo"}'), ("ping", "{}")]


def test_mistral_ids_are_nine_letters_and_digits() -> None:
    parser = resolve_parser("mistral", None)
    message, reason = ToolReader(parser, NAMES).message(
        '[TOOL_CALLS][{"name": "ping", "arguments": {}}]', "stop")
    assert reason == "tool_calls"
    assert re.fullmatch(r"[A-Za-z0-9]{9}", message.tool_calls[0].id)
    delta, _ = ToolReader(parser, NAMES).delta(0, "[TOOL_CALLS]ping[ARGS]{}", True, "stop")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", delta.tool_calls[0].id)
    # The other formats keep OpenAI's ids.
    assert resolve_parser("llama3_json", None).new_call_id().startswith("call_")


def test_chosen_by_chat_template() -> None:
    assert resolve_parser("auto", "{{ '[TOOL_CALLS]' + tool_calls | tojson }}").name == \
        "mistral"
    qwen3_coder = "<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>\n"
    assert resolve_parser("auto", qwen3_coder).name == "qwen3_coder"
    llama = '{{- "<|python_tag|>" + tool_call.name }}{"name": ..., "parameters": ...}'
    assert resolve_parser("auto", llama).name == "llama3_json"
    # Unchanged: Hermes's <tool_call> template, and a template that knows no tools.
    assert resolve_parser("auto", "<tool_call>\n{{ call | tojson }}").name == "hermes"
    assert resolve_parser("auto", "{{ messages }}").name == "hermes"
    assert resolve_parser("pythonic", "[TOOL_CALLS]").name == "pythonic"


def test_cut_short_keeps_valid_arguments() -> None:
    qwen = resolve_parser("qwen3_coder", None)
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n" \
           "<parameter=city>\nPar"
    assert qwen.parse(text, NAMES, SCHEMAS) == \
        (None, [ParsedCall("get_weather", '{"days": 4, "city": "Par"}')])
    pythonic = resolve_parser("pythonic", None)
    assert pythonic.parse('[get_weather(days=4, city="Pa', NAMES, SCHEMAS) == \
        (None, [ParsedCall("get_weather", '{"days": 4}')])


FUNCTIONS = {"get_weather": SCHEMAS["get_weather"], "ping": None}


def _accepts(ebnf: str, text: str) -> bool:
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "</s>"]
    info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf)
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("name", list(FORMAT_PARSERS))
def test_forced_call_grammar_is_read_as_a_call(name: str) -> None:
    parser = resolve_parser(name, None)
    one = parser.format_calls([("get_weather", {"city": "Rome", "days": 2})])
    two = parser.format_calls([("get_weather", {"city": "Rome"}), ("ping", {})])
    single, parallel = (parser.forced_grammar(FUNCTIONS, p) for p in (False, True))
    assert _accepts(single, one) and _accepts(parallel, two)
    assert not _accepts(single, two)
    assert not _accepts(single, "I'd rather not.")
    assert not _accepts(single, one.replace("get_weather", "get_wether"))
    assert parser.parse(one, NAMES, SCHEMAS)[1][0].name == "get_weather"


def _walk(ebnf: str, rng: random.Random) -> str:
    """A random sentence of the grammar: random allowed characters, closing ones preferred
    after a while so that values end."""
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "</s>"]
    eos = len(vocab) - 1
    closers = {i for i, t in enumerate(vocab) if t in "\"')]}<>\n0" or i == eos}
    info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[eos])
    matcher = xgrammar.GrammarMatcher(
        xgrammar.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf))
    bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))
    shifts = torch.arange(32, dtype=torch.int32)
    text = []
    for step in range(4000):
        if matcher.is_terminated():
            return "".join(text)
        matcher.fill_next_token_bitmask(bitmask)
        bits = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:len(vocab)]
        allowed = bits.nonzero().flatten().tolist()
        closing = [t for t in allowed if t in closers]
        token = rng.choice(closing if closing and step > 30 and rng.random() < 0.7 else allowed)
        assert matcher.accept_token(token)
        if token != eos:
            text.append(vocab[token])
    raise AssertionError(f"no end: {''.join(text)!r}")


@pytest.mark.parametrize("name", ["qwen3_coder", "pythonic"])
def test_every_walk_of_the_grammar_is_a_call(name: str) -> None:
    parser = resolve_parser(name, None)
    ebnf = parser.forced_grammar(FUNCTIONS, True)
    rng = random.Random(0)
    for _ in range(30):
        text = _walk(ebnf, rng)
        content, calls = parser.parse(text, NAMES, SCHEMAS)
        assert content is None and calls, text
        for call in calls:
            assert isinstance(json.loads(call.arguments), dict)
