"""Tool-call formats: how a model writes its function calls, and how its text is read back.

Both formats wrap JSON in ``<tool_call>`` markup. Hermes (Qwen2.5, Qwen3, Hermes-2/3) writes
one ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block per call; SmolLM2
writes one block holding a JSON list of calls, ``<tool_call>[{...}, {...}]</tool_call>``. Each
reader accepts either body (an object or a list of them), since a model does not always keep
to its own format.

Reading is incremental (``ToolCallStream``): the text outside the markup passes through as
content, and the JSON inside a block is read as it comes (api/tool_json.py): a call's first
delta names the function, the next ones carry its arguments in pieces. A block that turns out
not to be a call (not JSON, an unknown function) before any call in it started is given back
as plain content. A whole text is read by feeding it in one piece, so the streamed and the
whole answer always agree. Whitespace next to a call is dropped; every other character of the
model's text outside a call is kept.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from tokenmill.api.tool_json import CLOSE_TAG, CallBlock, CallDelta

OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    """One function call read from the model's text; ``arguments`` is a JSON object's text."""

    name: str
    arguments: str


@dataclass
class ToolEvents:
    """What a piece of model text turned into: content to pass on, and pieces of calls."""

    content: str = ""
    deltas: list[CallDelta] = field(default_factory=list)

    def extend(self, other: ToolEvents) -> None:
        self.content += other.content
        self.deltas.extend(other.deltas)


def assemble(deltas: Iterable[CallDelta]) -> list[ParsedCall]:
    """The calls that ``deltas`` (all of a sequence's, in order) add up to."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        arguments.setdefault(d.index, []).append(d.arguments)
    return [ParsedCall(names[i], "".join(arguments[i])) for i in sorted(names)]


class CallStream(Protocol):
    """A reader of one output sequence's text, as it is generated (``ToolCallStream`` for the
    ``<tool_call>`` formats, api/tool_formats.py's ``FormatStream`` for the others)."""

    @property
    def num_calls(self) -> int: ...

    @property
    def ended_calls(self) -> int: ...

    def feed(self, text: str) -> ToolEvents: ...

    def finish(self) -> ToolEvents: ...


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStream:
    """Reads one output sequence's text as it is generated (see the module docstring)."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self._buf = ""  # text outside the markup received and not yet passed on
        self._block: CallBlock | None = None  # the block being read
        self._gap = ""  # whitespace before the open tag: dropped if the block is a call
        self._after_call = False  # whitespace that follows a call is dropped
        self._done_calls = 0  # calls of the blocks already ended

    @property
    def num_calls(self) -> int:
        """Calls started so far."""
        return self._done_calls + (self._block.started if self._block is not None else 0)

    @property
    def ended_calls(self) -> int:
        """Calls known to be whole: those of the blocks that have ended."""
        return self._done_calls

    def feed(self, text: str) -> ToolEvents:
        """The content and the pieces of calls that ``text`` (the next piece) makes known."""
        self._buf += text
        out = ToolEvents()
        while True:
            if self._block is not None:
                rest = self._block.feed(self._buf)
                self._buf = ""
                out.deltas.extend(self._block.take())
                if rest is None:
                    return out
                out.content += self._end_block(closed=True)
                self._buf = rest
                continue
            start = self._buf.find(OPEN_TAG)
            if start < 0:
                # Hold back what may begin a tag, and trailing whitespace a call may drop.
                keep = len(self._buf) - _partial_tag_len(self._buf, OPEN_TAG)
                cut = len(self._buf[:keep].rstrip())
                out.content += self._content(self._buf[:cut])
                self._buf = self._buf[cut:]
                return out
            before = self._buf[:start]
            stripped = before.rstrip()
            out.content += self._content(stripped)
            self._gap = before[len(stripped):]
            self._buf = self._buf[start + len(OPEN_TAG):]
            self._block = CallBlock(self.names, self.num_calls)

    def finish(self) -> ToolEvents:
        """Whatever is still held back, at the end of the sequence: an unclosed block whose
        calls started keeps them, any other is given back as content."""
        if self._block is not None:
            deltas = self._block.take()
            return ToolEvents(self._end_block(closed=False), deltas)
        rest, self._buf = self._buf, ""
        if self._after_call and not rest.strip():
            return ToolEvents()
        return ToolEvents(self._content(rest))

    def _content(self, text: str) -> str:
        if self._after_call and text:
            text = text.lstrip()
            self._after_call = not text
        return text

    def _end_block(self, closed: bool) -> str:
        """The content an ended block gives back: none if it was a call, else all of it."""
        block, self._block = self._block, None
        assert block is not None
        gap, self._gap = self._gap, ""
        if block.started:
            self._done_calls += block.started
            self._after_call = True
            return ""
        return self._content(gap) + OPEN_TAG + block.raw + (CLOSE_TAG if closed else "")


def parse_text(text: str, names: Collection[str]) -> tuple[str | None, list[ParsedCall]]:
    """A whole output read at once: its content (None if nothing is left) and its calls."""
    stream = ToolCallStream(names)
    events = stream.feed(text)
    events.extend(stream.finish())
    calls = assemble(events.deltas)
    return (events.content or None) if calls else events.content, calls


@dataclass(frozen=True)
class CallFormat:
    """How a model writes a turn of calls: ``open`` + call + (``sep`` + call)* + ``close``,
    each call ``{"name": ..., "arguments": ...}`` in compact JSON."""

    open: str
    sep: str
    close: str


class ToolParser:
    """A tool-call format: its reader, its writer (for the conversation's earlier calls) and
    the instructions given to a model whose chat template knows no tools."""

    name: ClassVar[str]
    format: ClassVar[CallFormat]
    # The format's markup is special tokens (Mistral's [TOOL_CALLS]): the output's text must
    # keep them for the calls to be read (api/tools.py hides them from the content).
    keeps_special_tokens: ClassVar[bool] = False

    def for_template(self, template: str | None) -> ToolParser:
        """This format as the model's chat template writes it (a variant, or itself)."""
        return self

    def with_reasoning(self, reasoning_parser: str | None) -> ToolParser:
        """The format to use when ``reasoning_parser`` (its name; None: no parser) reads the
        output before this one (itself, unless the format relies on that parser)."""
        return self

    def stream(self, names: Collection[str],
               schemas: Mapping[str, Any] | None = None) -> CallStream:
        """A reader of one output sequence; ``names``: the functions it may call;
        ``schemas``: their parameters' JSON schemas (formats that type their values read
        them)."""
        return ToolCallStream(names)

    def parse(self, text: str, names: Collection[str],
              schemas: Mapping[str, Any] | None = None) -> tuple[str | None, list[ParsedCall]]:
        """A whole output read at once (by feeding it to ``stream`` in one piece, so the
        streamed and the whole answer agree): its content (None if nothing is left when it
        made calls) and its calls."""
        stream = self.stream(names, schemas)
        events = stream.feed(text)
        events.extend(stream.finish())
        calls = assemble(events.deltas)
        return (events.content or None) if calls else events.content, calls

    def forced_grammar(self, functions: Mapping[str, Mapping[str, Any] | None],
                       parallel: bool, prompt: str | None = None) -> str:
        """EBNF of a turn of calls in this format to ``functions`` (name -> parameters
        schema): one call, or one or more when ``parallel``; ``prompt``: the rendered chat
        the output follows (formats whose opening depends on it read it). ValueError naming
        a function whose schema cannot be used."""
        # Imported here: the grammar module reads this one's CallFormat.
        from tokenmill.api.tool_grammar import tool_call_grammar

        return tool_call_grammar(self.format, functions, parallel)

    def new_call_id(self) -> str:
        """A new call's id: OpenAI's shape, ``call_`` and 24 hex digits."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def format_calls(self, calls: Iterable[tuple[str, Any]]) -> str:
        """``(name, arguments)`` pairs written the way the model writes them."""
        f = self.format
        return f.open + f.sep.join(_call_json(n, a) for n, a in calls) + f.close

    def format_result(self, content: str, name: str | None = None) -> str:
        """A tool's result, as the model expects to read it back (``name``: the function
        that was called, where known; formats that name it read it)."""
        return f"<tool_response>\n{content}\n</tool_response>"

    def expand_history(self, rendered: str) -> str:
        """The rendered prompt with the markup of earlier calls that message content cannot
        hold put in (formats whose markup is control tokens; the others: as it is)."""
        return rendered

    def system_prompt(self, functions: list[dict[str, Any]], must_call: str | None) -> str:
        """The instructions that describe the tools and the call format. ``must_call``: the
        one function to call, "" for any of them, None when the model may answer in text."""
        listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
        example = self.format_calls([("<function-name>", {"<argument>": "<value>"})])
        if must_call:
            rule = f"Answer with a call to the function {must_call}."
        elif must_call == "":
            rule = "Answer with one or more function calls."
        else:
            rule = "Call a function when it helps to answer; otherwise answer in plain text."
        return (f"You can call these functions (JSON schemas of their arguments):\n<tools>\n"
                f"{listed}\n</tools>\n{rule} Write calls exactly like this, with no other "
                f"text:\n{example}")


def _call_json(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


class HermesParser(ToolParser):
    """Hermes / Qwen: one ``<tool_call>`` block per call."""

    name = "hermes"
    format = CallFormat(open=f"{OPEN_TAG}\n", sep=f"\n{CLOSE_TAG}\n{OPEN_TAG}\n",
                        close=f"\n{CLOSE_TAG}")


class SmolLMParser(ToolParser):
    """SmolLM2: one ``<tool_call>`` block holding a JSON list of every call."""

    name = "smollm"
    format = CallFormat(open=f"{OPEN_TAG}[\n", sep=",\n", close=f"\n]{CLOSE_TAG}")


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, SmolLMParser)}
# A chat template that writes the calls of a turn as one list.
_LIST_TEMPLATE = re.compile(re.escape(OPEN_TAG) + r"\s*\[")


def named_parsers() -> dict[str, type[ToolParser]]:
    """Every format ``--tool-call-parser`` can name (``auto`` aside), by name."""
    # Imported here: the other formats build on this module.
    from tokenmill.api.tool_formats import FORMAT_PARSERS
    from tokenmill.api.tool_harmony import HarmonyToolParser

    return PARSERS | FORMAT_PARSERS | {HarmonyToolParser.name: HarmonyToolParser}


def resolve_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser ``name`` names; ``auto`` reads the model's chat template: one that writes
    Mistral's ``[TOOL_CALLS]``, Qwen3-Coder's ``<function=...>`` or Llama 3's JSON calls picks
    that format (api/tool_formats.py), gpt-oss's harmony picks harmony's
    (api/tool_harmony.py), one that writes ``<tool_call>`` blocks picks theirs,
    SmolLM's own template picks SmolLM's, anything else gets Hermes (then described to the
    model in the system prompt)."""
    # Imported here: the other formats build on this module.
    from tokenmill.api.tool_formats import format_by_template
    from tokenmill.api.tool_harmony import HarmonyToolParser, is_harmony_template

    parsers = named_parsers()
    if name != "auto":
        if name not in parsers:
            raise ValueError(f"tool_call_parser must be auto or one of {sorted(parsers)}, "
                             f"got {name!r}")
        return parsers[name]().for_template(chat_template)
    template = chat_template or ""
    found = format_by_template(template)
    if found is not None:
        return found
    if is_harmony_template(template):
        return HarmonyToolParser()
    if OPEN_TAG in template:
        return SmolLMParser() if _LIST_TEMPLATE.search(template) else HermesParser()
    if "SmolLM" in template:
        return SmolLMParser()
    return HermesParser()
