"""The forced-call grammar, matched with xgrammar's GrammarMatcher: valid calls are accepted,
invalid ones refused, and every walk through the grammar is a call the parser reads and whose
arguments validate against the function's schema."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar

from tokenmill.api.tool_grammar import arguments_schema, tool_call_grammar
from tokenmill.api.tool_parsers import HermesParser, SmolLMParser, ToolParser, parse_text

FUNCTIONS: dict[str, dict[str, Any] | None] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]},
    "book": {
        "type": "object",
        "properties": {
            "guests": {"type": "array", "minItems": 1, "maxItems": 3,
                       "items": {"type": "object",
                                 "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                                                "age": {"type": "number", "minimum": 0,
                                                        "maximum": 120}},
                                 "required": ["name"], "additionalProperties": False}},
            "when": {"anyOf": [{"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
                               {"type": "null"}]},
            "vip": {"type": "boolean"}},
        "required": ["guests", "when"]},
    "now": None,  # no parameters: the empty object
}
PARSERS = [HermesParser(), SmolLMParser()]
# A character-level vocabulary (plus a few longer pieces and an end token): walks through the
# grammar at the level of characters, as a model with a byte-level vocabulary can.
VOCAB = ([chr(c) for c in range(32, 127)] + ["\n", "<tool_call>", "</tool_call>", '{"name": ',
                                              '", "arguments": ', "</s>"])
EOS = len(VOCAB) - 1
CLOSERS = {i for i, t in enumerate(VOCAB) if t in ('"', "}", "]", "0", "1", "\n", "<")}


def _compiled(ebnf: str) -> xgrammar.CompiledGrammar:
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgrammar.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf)


def _accepts(compiled: xgrammar.CompiledGrammar, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("parser", PARSERS, ids=["hermes", "smollm"])
def test_valid_calls_accepted_invalid_refused(parser: ToolParser) -> None:
    compiled = _compiled(tool_call_grammar(parser.format, FUNCTIONS, parallel=True))
    one = parser.format_calls([("get_weather", {"city": "Paris", "days": 3})])
    two = parser.format_calls([("now", {}), ("get_weather", {"city": "Oslo", "unit": "celsius"})])
    assert _accepts(compiled, one) and _accepts(compiled, two)
    bad = [
        parser.format_calls([("get_weather", {"days": 3})]),  # required city missing
        parser.format_calls([("get_weather", {"city": "Paris", "days": 9})]),  # over maximum
        parser.format_calls([("get_weather", {"city": "Paris", "wind": 1})]),  # unknown key
        parser.format_calls([("get_weather", {"city": "Paris", "unit": "kelvin"})]),
        parser.format_calls([("send_mail", {})]),  # not a tool
        parser.format_calls([("now", {"x": 1})]),  # no parameters: only {}
        parser.format_calls([("book", {"guests": [], "when": None})]),  # minItems
        parser.format_calls([("book", {"guests": [{"name": "ann"}], "when": None})]),  # pattern
        "Sure! " + one,  # no text before the call
        one[:-3],  # unfinished
        '{"name": "now", "arguments": {}}',  # no markup
    ]
    for text in bad:
        assert not _accepts(compiled, text), text


@pytest.mark.parametrize("parser", PARSERS, ids=["hermes", "smollm"])
def test_one_call_unless_parallel(parser: ToolParser) -> None:
    compiled = _compiled(tool_call_grammar(parser.format, FUNCTIONS, parallel=False))
    assert _accepts(compiled, parser.format_calls([("now", {})]))
    assert not _accepts(compiled, parser.format_calls([("now", {}), ("now", {})]))


def test_named_function_only() -> None:
    parser = HermesParser()
    compiled = _compiled(tool_call_grammar(parser.format, {"now": None}, parallel=True))
    assert _accepts(compiled, parser.format_calls([("now", {})]))
    assert not _accepts(compiled, parser.format_calls([("get_weather", {"city": "Paris"})]))


def _walk(compiled: xgrammar.CompiledGrammar, rng: random.Random, max_steps: int = 4000) -> str:
    """A random sentence of the grammar: random allowed tokens, closing ones preferred after
    a while so that strings and numbers end."""
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, len(VOCAB))
    shifts = torch.arange(32, dtype=torch.int32)
    text = []
    for step in range(max_steps):
        if matcher.is_terminated():
            return "".join(text)
        matcher.fill_next_token_bitmask(bitmask)
        bits = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:len(VOCAB)]
        allowed = bits.nonzero().flatten().tolist()
        closing = [t for t in allowed if t in CLOSERS or t == EOS]
        token = rng.choice(closing if closing and step > 40 and rng.random() < 0.7 else allowed)
        assert matcher.accept_token(token)
        if token != EOS:
            text.append(VOCAB[token])
    raise AssertionError(f"no end after {max_steps} tokens: {''.join(text)!r}")


@pytest.mark.parametrize("parser", PARSERS, ids=["hermes", "smollm"])
@pytest.mark.parametrize("parallel", [True, False])
def test_every_walk_is_a_valid_call(parser: ToolParser, parallel: bool) -> None:
    compiled = _compiled(tool_call_grammar(parser.format, FUNCTIONS, parallel))
    rng = random.Random(0)
    for _ in range(40):
        text = _walk(compiled, rng)
        content, calls = parse_text(text, FUNCTIONS)
        assert content is None and calls, text
        assert len(calls) == 1 or parallel
        for call in calls:
            jsonschema.validate(json.loads(call.arguments),
                                arguments_schema(FUNCTIONS[call.name]))


def test_unreadable_schema_names_the_function() -> None:
    with pytest.raises(ValueError, match="'f'"):
        tool_call_grammar(HermesParser().format,
                          {"f": {"type": "object", "properties": {"x": {"type": "nonsense"}}}},
                          parallel=True)
