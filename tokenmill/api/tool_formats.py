"""More tool-call formats, as vLLM's parsers of the same names read them:

- ``llama3_json`` (Llama 3.1 / 3.2): ``<|python_tag|>`` or nothing, then a JSON object
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``); several calls are separated
  by ``;``. Without the tag, the output must begin with the object. The tag is a special
  token, kept in the text of a request with tools as Mistral's are (below).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}]``, or
  (newer templates) ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (``NAME[CALL_ID]ID[ARGS]`` read
  too). The tags are special tokens: a request with tools keeps special tokens in the
  output's text, and the tool reader takes them out of the content (api/tools.py); an output
  decoded without them that begins with the list is still read as calls. Mistral's templates
  want call ids of 9 letters and digits, so that is what they get.
- ``qwen3_coder`` and ``pythonic``: see api/tool_formats_text.py.

Each format is read by a ``FormatStream``: the text before the calls' opening passes through
as content; after it, a format's reader turns the calls into ``CallDelta``s, the first of a
call naming it, the next ones carrying its arguments' JSON in pieces as they are generated.
A reader that finds no call before its text goes wrong gives all of it back as content, so a
malformed call is text, never an error. A whole output is read by feeding it in one piece.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

from tokenmill.api.tool_json import CallBlock, CallDelta, JsonScanner
from tokenmill.api.tool_parsers import (
    CallFormat,
    ToolEvents,
    ToolParser,
    _partial_tag_len,
)

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits
_MAX_NAME = 64  # OpenAI's limit on a function's name (api/tools.py)


class CallReader(Protocol):
    """The calls after a format's opening: ``feed`` returns the text after them once they
    have ended (None while they go on); ``raw`` is the text they took."""

    @property
    def raw(self) -> str: ...

    @property
    def started(self) -> int: ...  # calls started (their first delta made)

    @property
    def ended(self) -> int: ...  # calls known to be whole

    def feed(self, text: str) -> str | None: ...

    def take(self) -> list[CallDelta]: ...

    def finish(self) -> None: ...


class FormatStream:
    """One output sequence read as it is generated: content, and the calls that begin at
    ``open_tag`` (or, ``bare``, at the output's first character when it is one of those)."""

    def __init__(self, open_tag: str, bare: str,
                 make_reader: Callable[[int], CallReader]) -> None:
        self._open_tag, self._bare, self._make_reader = open_tag, bare, make_reader
        self._buf = ""  # text outside the calls received and not yet passed on
        self._reader: CallReader | None = None
        self._opened = ""  # the text that opened the reader (its tag, or "")
        self._gap = ""  # whitespace before the opening: dropped if calls follow
        self._fresh = True  # only whitespace seen so far (a bare opening may come)
        self._after_call = False  # whitespace that follows calls is dropped
        self._done_calls = 0

    @property
    def num_calls(self) -> int:
        """Calls started so far."""
        return self._done_calls + (self._reader.started if self._reader else 0)

    @property
    def ended_calls(self) -> int:
        """Calls known to be whole."""
        return self._done_calls + (self._reader.ended if self._reader else 0)

    def feed(self, text: str) -> ToolEvents:
        """The content and the pieces of calls that ``text`` (the next piece) makes known."""
        self._buf += text
        out = ToolEvents()
        while True:
            if self._reader is not None:
                rest = self._reader.feed(self._buf)
                self._buf = ""
                out.deltas.extend(self._reader.take())
                if rest is None:
                    return out
                out.content += self._end_reader()
                self._buf = rest
                continue
            at, opened = self._find_opening()
            if at < 0:
                # Hold back what may begin the tag, and whitespace calls may drop.
                keep = len(self._buf) - _partial_tag_len(self._buf, self._open_tag)
                cut = len(self._buf[:keep].rstrip())
                self._fresh = self._fresh and cut == 0
                out.content += self._content(self._buf[:cut])
                self._buf = self._buf[cut:]
                return out
            before = self._buf[:at]
            stripped = before.rstrip()
            out.content += self._content(stripped)
            self._gap, self._opened, self._fresh = before[len(stripped):], opened, False
            self._buf = self._buf[at + len(opened):]
            self._reader = self._make_reader(self.num_calls)

    def finish(self) -> ToolEvents:
        """What is still held back, at the end of the output."""
        if self._reader is not None:
            self._reader.finish()
            deltas = self._reader.take()
            return ToolEvents(self._end_reader(), deltas)
        rest, self._buf = self._buf, ""
        if self._after_call and not rest.strip():
            return ToolEvents()
        return ToolEvents(self._content(rest))

    def _find_opening(self) -> tuple[int, str]:
        """Where the calls open in the buffer (-1 if not yet) and the text that opens them."""
        tag = self._open_tag
        if self._fresh and self._bare:
            body = self._buf.lstrip()
            if body and body[0] in self._bare and not body.startswith(tag) \
                    and not tag.startswith(body):
                return len(self._buf) - len(body), ""
        return self._buf.find(tag), tag

    def _content(self, text: str) -> str:
        if self._after_call and text:
            text = text.lstrip()
            self._after_call = not text
        return text

    def _end_reader(self) -> str:
        """The content an ended reader gives back: none if it read calls, else its text."""
        reader, self._reader = self._reader, None
        assert reader is not None
        gap, self._gap = self._gap, ""
        if reader.started:
            self._done_calls += reader.started
            self._after_call = True
            return ""
        return self._content(gap) + self._opened + reader.raw


class JsonCallsReader:
    """JSON call objects (or lists of them) one after another, each ended by ``close`` (None:
    only the end of the output), read by api/tool_json.py's ``CallBlock``."""

    def __init__(self, names: Collection[str], first_index: int, close: str | None) -> None:
        self.raw, self.started, self.ended = "", 0, 0
        self._names, self._first, self._close = names, first_index, close
        self._block = CallBlock(names, first_index, close)
        self._deltas: list[CallDelta] = []

    def feed(self, text: str) -> str | None:
        self.raw += text
        while True:
            block = self._block
            rest = block.feed(text)
            self._deltas.extend(block.take())
            if rest is None:
                if block.broken and not block.started:  # not a call: no need to wait
                    return self._give_back(block.raw)
                return None
            if not block.started:  # a closed block that was no call: content again
                return self._give_back(block.raw + (self._close or "") + rest)
            self.started += block.started
            self.ended = self.started
            self._block = CallBlock(self._names, self._first + self.started, self._close)
            text = rest

    def _give_back(self, text: str) -> str:
        """End here: ``text`` (the current block's and what follows) is not calls; before any
        call, all of the reader's text is content (returned as its ``raw``)."""
        if not self.started:
            return ""
        self.raw = self.raw[:len(self.raw) - len(text)]
        return text

    def take(self) -> list[CallDelta]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def finish(self) -> None:
        # An unclosed block keeps the calls it started (the output was cut short).
        self._deltas.extend(self._block.take())
        self.started += self._block.started
        self.ended = self.started


class ArgsCallsReader:
    """Mistral's newer calls: ``NAME[ARGS]{...}``, the next one after another ``[TOOL_CALLS]``."""

    def __init__(self, names: Collection[str], first_index: int) -> None:
        self.raw, self.started, self.ended = "", 0, 0
        self._names, self._first = names, first_index
        self._state = "name"  # "name", "args" (after the opening brace), "next"
        self._buf = ""  # text of the state not yet read
        self._scanner = JsonScanner()
        self._deltas: list[CallDelta] = []
        self._pieces: list[str] = []

    def feed(self, text: str) -> str | None:
        self.raw += text
        self._buf += text
        rest = self._read()
        self._flush()
        if rest is not None:
            self.raw = self.raw[:len(self.raw) - len(rest)]
        return rest

    def _read(self) -> str | None:
        while True:
            if self._state == "name":
                at = self._buf.find(ARGS)
                head = self._buf[:at].strip() if at >= 0 else self._buf.lstrip()
                # Templates that keep call ids write NAME[CALL_ID]ID[ARGS]: the id is ours.
                head = head.split(CALL_ID, 1)[0].rstrip()
                if at < 0:
                    return None if len(head) <= _MAX_NAME and " " not in head else \
                        self._stop(self._buf)
                body = self._buf[at + len(ARGS):].lstrip()
                if not body:
                    return None
                if head not in self._names or body[0] != "{":
                    return self._stop(self._buf)
                self._flush()  # the previous call's last piece
                self._deltas.append(CallDelta(self._first + self.started, head, ""))
                self.started += 1
                self._state, self._buf, self._scanner = "args", body, JsonScanner()
            elif self._state == "args":
                for i, ch in enumerate(self._buf):
                    out = self._scanner.push(ch)
                    if out is None:  # broken: the call ends with the arguments it has
                        self.ended = self.started
                        return self._buf[i:]
                    self._pieces.append(out)
                    if self._scanner.done:
                        self.ended = self.started
                        self._state, self._buf = "next", self._buf[i + 1:]
                        break
                else:
                    self._buf = ""
                    return None
            else:
                body = self._buf.lstrip()
                if body.startswith(TOOL_CALLS):
                    self._state, self._buf = "name", body[len(TOOL_CALLS):]
                elif TOOL_CALLS.startswith(body):
                    return None
                else:
                    return self._buf

    def _stop(self, rest: str) -> str:
        """Not a call: before any call, all of the text is content; after one, ``rest``."""
        return "" if not self.started else rest

    def _flush(self) -> None:
        if self._pieces:
            self._deltas.append(CallDelta(self._first + self.started - 1, None,
                                          "".join(self._pieces)))
            self._pieces = []

    def take(self) -> list[CallDelta]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def finish(self) -> None:
        self.ended = self.started


class MistralReader:
    """After ``[TOOL_CALLS]``: a JSON list (or object) of calls, or ``NAME[ARGS]{...}``."""

    def __init__(self, names: Collection[str], first_index: int) -> None:
        self._names, self._first = names, first_index
        self._held = ""
        self._inner: CallReader | None = None

    @property
    def raw(self) -> str:
        return self._inner.raw if self._inner is not None else self._held

    @property
    def started(self) -> int:
        return self._inner.started if self._inner is not None else 0

    @property
    def ended(self) -> int:
        return self._inner.ended if self._inner is not None else 0

    def feed(self, text: str) -> str | None:
        if self._inner is None:
            self._held += text
            body = self._held.lstrip()
            if not body:
                return None
            # A list may be followed by another [TOOL_CALLS] and list.
            self._inner = JsonCallsReader(self._names, self._first, TOOL_CALLS) \
                if body[0] in "[{" else ArgsCallsReader(self._names, self._first)
            text, self._held = self._held, ""
        return self._inner.feed(text)

    def take(self) -> list[CallDelta]:
        return self._inner.take() if self._inner is not None else []

    def finish(self) -> None:
        if self._inner is not None:
            self._inner.finish()


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2's JSON calls (see the module docstring)."""

    name = "llama3_json"
    format = CallFormat(open="", sep="; ", close="")
    # <|python_tag|> is a special token: a call after text is found only by it.
    keeps_special_tokens = True

    def stream(self, names: Collection[str],
               schemas: Mapping[str, Any] | None = None) -> FormatStream:
        return FormatStream(PYTHON_TAG, "{", lambda first: JsonCallsReader(names, first, ";"))


class MistralParser(ToolParser):
    """Mistral's ``[TOOL_CALLS]`` (see the module docstring); ``args_form``: the model writes
    ``[TOOL_CALLS]NAME[ARGS]{...}`` (its chat template does), which is then what a forced
    call's grammar and the written history use."""

    name = "mistral"
    format = CallFormat(open=f"{TOOL_CALLS}[", sep=", ", close="]")
    keeps_special_tokens = True

    def __init__(self, args_form: bool = False) -> None:
        self.args_form = args_form

    def for_template(self, template: str | None) -> MistralParser:
        return MistralParser(args_form=ARGS in (template or ""))

    def stream(self, names: Collection[str],
               schemas: Mapping[str, Any] | None = None) -> FormatStream:
        return FormatStream(TOOL_CALLS, "[", lambda first: MistralReader(names, first))

    def forced_grammar(self, functions: Mapping[str, Mapping[str, Any] | None],
                       parallel: bool, prompt: str | None = None) -> str:
        if not self.args_form:
            return super().forced_grammar(functions, parallel, prompt)
        from tokenmill.api.tool_grammar import CallFrame, framed_call_grammar

        return framed_call_grammar(CallFrame(head=f"{TOOL_CALLS}{{name}}{ARGS}"), functions,
                                   parallel)

    def format_calls(self, calls: Iterable[tuple[str, Any]]) -> str:
        if not self.args_form:
            return super().format_calls(calls)
        return "".join(f"{TOOL_CALLS}{name}{ARGS}{json.dumps(args, ensure_ascii=False)}"
                       for name, args in calls)

    def new_call_id(self) -> str:
        """Nine letters and digits: Mistral's chat templates refuse any other id."""
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def _format_parsers() -> dict[str, type[ToolParser]]:
    from tokenmill.api.tool_formats_text import PythonicParser, Qwen3CoderParser

    return {p.name: p for p in (Llama3JsonParser, MistralParser, Qwen3CoderParser,
                                PythonicParser)}


FORMAT_PARSERS: dict[str, type[ToolParser]] = _format_parsers()


def format_by_template(template: str) -> ToolParser | None:
    """The format a chat template writes its calls in, when it is one of these (Qwen3-Coder's
    before Hermes's: its template also writes ``<tool_call>``); None otherwise."""
    if TOOL_CALLS in template:
        return MistralParser(args_form=ARGS in template)
    if "<function=" in template and "<parameter=" in template:
        return FORMAT_PARSERS["qwen3_coder"]()
    if PYTHON_TAG in template:
        return Llama3JsonParser()
    return None
