"""The tool-call readers: whole texts and the same texts streamed in every split."""

from __future__ import annotations

import json

import pytest

from tokenmill.api.tool_formats import FORMAT_PARSERS
from tokenmill.api.tool_parsers import (
    PARSERS,
    HermesParser,
    ParsedCall,
    SmolLMParser,
    ToolParser,
    assemble,
    named_parsers,
    parse_text,
    resolve_parser,
)
from tokenmill.config import TOOL_CALL_PARSERS

NAMES = {"get_weather", "get_time"}
WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris"}))
TIME = ParsedCall("get_time", json.dumps({"zone": "CET", "24h": True}))

HERMES_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "24h": true}}\n'
              '</tool_call>')
SMOL_TWO = ('<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
            '{"name": "get_time", "arguments": {"zone": "CET", "24h": true}}\n]</tool_call>')

# (text, expected content, expected calls)
CASES: list[tuple[str, str | None, list[ParsedCall]]] = [
    ("Just text, no calls.", "Just text, no calls.", []),
    ("  spaces kept \n", "  spaces kept \n", []),
    ("", "", []),
    (HERMES_TWO, None, [WEATHER, TIME]),
    (SMOL_TWO, None, [WEATHER, TIME]),
    ("Let me look.\n\n" + HERMES_TWO + "\n", "Let me look.", [WEATHER, TIME]),
    (SMOL_TWO + "\nDone, see above.", "Done, see above.", [WEATHER, TIME]),
    # whitespace next to a call goes with it
    ('A <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> B',
     "AB", [WEATHER]),
    # arguments given as a JSON text, and "parameters" for "arguments"
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
     None, [WEATHER]),
    ('<tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>',
     None, [WEATHER]),
    # unclosed at the end, but complete JSON: a call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', None, [WEATHER]),
    # the markup's text inside an argument is part of the argument
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "</tool_call>\\"<tool_call>"}}'
     '</tool_call>', None, [ParsedCall("get_weather", '{"city": "</tool_call>\\"<tool_call>"}')]),
    # malformed before a call starts: everything stays content, character for character
    ('x\n<tool_call>{"name": "send_mail", "arguments": {}}</tool_call>',
     'x\n<tool_call>{"name": "send_mail", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>', []),
    ("<tool_call>[]</tool_call>", "<tool_call>[]</tool_call>", []),
    ('<tool_call>{"name": "get_weather", "arg', '<tool_call>{"name": "get_weather", "arg', []),
    ("a <tool_c", "a <tool_c", []),
    ("<tool_call> </tool_call> <tool", "<tool_call> </tool_call> <tool", []),
    # one good call, one unknown: the good one is a call, the other stays content
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', [WEATHER]),
    # a call whose arguments began stands (they were streamed): JSON that breaks off ends its
    # arguments there, and the rest of its block is dropped
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> after',
     "after", [ParsedCall("get_weather", '{"city": ')]),
    ('<tool_call>{"name": "get_weather", "arguments": {"t": NaN}}</tool_call>',
     None, [ParsedCall("get_weather", '{"t": ')]),
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": 3}]'
     '</tool_call>', None, [WEATHER]),
    # cut off by max_tokens: the arguments written so far
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None,
     [ParsedCall("get_weather", '{"city": "Par')]),
    ('<tool_call>{"name": "get_weather", "arguments": ', '<tool_call>{"name": "get_weather", '
     '"arguments": ', []),
    # whitespace between tokens as json.dumps writes it; tokens as the model wrote them
    ('<tool_call>{ "name" :"get_weather","arguments":{\n "city" :"Pa\\u00efris\\n",'
     '"n":[1 ,-2.5e3,{ }],"ok" : null } }</tool_call>', None,
     [ParsedCall("get_weather", '{"city": "Pa\\u00efris\\n", "n": [1, -2.5e3, {}], '
                 '"ok": null}')]),
    # arguments before the name, no arguments, other keys ignored
    ('<tool_call>{"arguments": {"city": "Paris"}, "id": 7, "name": "get_weather"}</tool_call>',
     None, [WEATHER]),
    ('<tool_call>{"name": "get_time", "id": [1, {"a": 2}]}</tool_call>', None,
     [ParsedCall("get_time", "{}")]),
    # names that are not strings, twice given, or unknown; a body that is no object
    ('<tool_call>{"name": "get_time", "name": "get_weather"}</tool_call>',
     '<tool_call>{"name": "get_time", "name": "get_weather"}</tool_call>', []),
    ("<tool_call>{}</tool_call>", "<tool_call>{}</tool_call>", []),
    ('<tool_call>"get_time"</tool_call>', '<tool_call>"get_time"</tool_call>', []),
    ('<tool_call>{"name": "get_weather", "arguments": "[1]"}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": "[1]"}</tool_call>', []),
    # text after the JSON inside the block: a call that started stands, the rest is dropped
    ('<tool_call>{"name": "get_time", "arguments": {}} oops</tool_call>x', "x",
     [ParsedCall("get_time", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole(text: str, content: str | None, calls: list[ParsedCall]) -> None:
    assert parse_text(text, NAMES) == (content, calls)


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    stream = parser.stream(NAMES)
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        events = stream.feed(piece)
        if i == len(pieces) - 1:
            events.extend(stream.finish())
        content += events.content
        deltas += events.deltas
    # Each call: first its name with arguments "", then only pieces of its arguments.
    firsts = [d for d in deltas if d.name is not None]
    assert [d.index for d in firsts] == list(range(len(firsts)))
    assert all(d.arguments == "" for d in firsts)
    assert all(d.arguments for d in deltas if d.name is None)
    return content, assemble(deltas)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
@pytest.mark.parametrize("parser", [HermesParser(), SmolLMParser()], ids=["hermes", "smollm"])
def test_streamed_in_every_split(parser: ToolParser, text: str, content: str | None,
                                 calls: list[ParsedCall]) -> None:
    """Two pieces split anywhere, and one character at a time, read as the whole text."""
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text) or [""]]
    for pieces in splits:
        assert _streamed(parser, pieces) == (content or "", calls), pieces


def test_markup_of_a_good_call_never_reaches_content() -> None:
    text = "Sure.\n" + HERMES_TWO
    stream = HermesParser().stream(NAMES)
    seen = ""
    for ch in text:
        events = stream.feed(ch)
        seen += events.content
        assert "<" not in seen and "{" not in seen, seen
    assert seen == "Sure."
    assert stream.finish().content == ""
    assert stream.num_calls == 2


@pytest.mark.parametrize("parser", [HermesParser(), SmolLMParser()], ids=["hermes", "smollm"])
def test_written_calls_read_back(parser: ToolParser) -> None:
    """What format_calls writes (earlier turns, the system prompt's example) parses back."""
    text = parser.format_calls([("get_weather", {"city": "Paris"}),
                                ("get_time", {"zone": "CET", "24h": True})])
    assert parse_text(text, NAMES) == (None, [WEATHER, TIME])
    assert "<tool_call>" in parser.system_prompt([{"name": "get_weather"}], None)


def test_resolve_parser() -> None:
    hermes_template = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n"
    smol_list = "<tool_call>[\n{{ calls }}]</tool_call>"
    assert resolve_parser("auto", hermes_template).name == "hermes"
    assert resolve_parser("auto", smol_list).name == "smollm"
    assert resolve_parser("auto", "You are a helpful AI assistant named SmolLM").name == "smollm"
    assert resolve_parser("auto", None).name == "hermes"
    assert resolve_parser("smollm", hermes_template).name == "smollm"
    with pytest.raises(ValueError, match="tool_call_parser"):
        resolve_parser("no_such_format", None)
    # The server's option lists exactly these (the others: tests/unit/test_tool_formats.py).
    assert set(TOOL_CALL_PARSERS) == {"auto", *named_parsers()}
    assert {*PARSERS, *FORMAT_PARSERS} < set(named_parsers())
