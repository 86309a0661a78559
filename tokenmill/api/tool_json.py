"""The JSON inside one ``<tool_call>`` block, read as it is generated, so that a call's
``arguments`` stream in pieces (as vLLM streams them) instead of in one piece at the end.

``JsonScanner`` reads one JSON value a character at a time and writes it normalised: no
whitespace between tokens, json.dumps's ", " and ": " between them, strings, numbers and
literals as the model wrote them. ``CallBlock`` reads a block's body, one call object or a list
of them (``{"name": ..., "arguments": {...}}``), into ``CallDelta``s. The text alone decides
every delta, never how it was split into pieces, so a text streamed and the same text read
whole give the same calls.

A call starts (its first delta names the function) when its name is known and its arguments
object begins, or when its object ends (arguments sent first, as a JSON text, or not at all);
its arguments then stream as they come. Before that, anything wrong (not JSON, an unknown
function, arguments that are not an object) makes the whole block plain text. After it, the
call stands: JSON that breaks off ends its arguments where they are (a truncated output keeps
the arguments written so far, as vLLM's do), and the rest of the block is dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass

from tokenmill.api.errors import MAX_JSON_DEPTH, loads_json

CLOSE_TAG = "</tool_call>"
_WS = frozenset(" \t\n\r")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?\Z")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class CallDelta:
    """A piece of a call: its first names the function (``name``, ``arguments`` ""), later
    ones carry the next piece of its arguments' JSON text (``name`` None)."""

    index: int
    name: str | None
    arguments: str


class JsonScanner:
    """One JSON value read a character at a time (see the module docstring)."""

    def __init__(self) -> None:
        self.done = False  # the value is complete
        self.broken = False  # a character could not continue it
        self.kind = ""  # the value's first character: "{", "[", '"', "t", "-", "1", ...
        self._stack: list[str] = []  # the closing character each open container waits for
        self._state = "value"
        self._key = False  # the string being read is an object's key
        self._escape = False  # after a backslash in a string
        self._hex = 0  # hex digits of a \u escape still to come
        self._rest = ""  # the rest of a literal (true, false, null)
        self._number = ""

    def push(self, ch: str) -> str | None:
        """Read ``ch``: its normalised text ("" for whitespace between tokens), or None when
        ``ch`` is not part of the value: it ended before ``ch`` (``done``) or ``ch`` breaks
        it (``broken``)."""
        if self.done or self.broken:
            return None
        state = self._state
        if state == "string":
            return self._string(ch)
        if state == "number":
            if ch in _NUMBER_CHARS:
                self._number += ch
                return ch
            if not _NUMBER.match(self._number):
                return self._break()
            self._end_value()
            return None if self.done else self.push(ch)
        if state == "literal":
            if ch != self._rest[0]:
                return self._break()
            self._rest = self._rest[1:]
            if not self._rest:
                self._end_value()
            return ch
        if ch in _WS:
            return ""
        if state == "first_item" and ch == "]" or state == "first_key" and ch == "}":
            return self._close(ch)
        if state in ("value", "first_item"):
            return self._start(ch)
        if state in ("first_key", "key"):
            if ch != '"':
                return self._break()
            self._state, self._key = "string", True
            return ch
        if state == "colon":
            if ch != ":":
                return self._break()
            self._state = "value"
            return ": "
        # After a value inside a container.
        if ch == ",":
            self._state = "key" if self._stack[-1] == "}" else "value"
            return ", "
        return self._close(ch) if ch == self._stack[-1] else self._break()

    def _start(self, ch: str) -> str | None:
        self.kind = self.kind or ch
        if ch in "{[":
            if len(self._stack) >= MAX_JSON_DEPTH:
                return self._break()
            self._stack.append("}" if ch == "{" else "]")
            self._state = "first_key" if ch == "{" else "first_item"
        elif ch == '"':
            self._state, self._key = "string", False
        elif ch == "-" or "0" <= ch <= "9":
            self._state, self._number = "number", ch
        elif ch in _LITERALS:
            self._state, self._rest = "literal", _LITERALS[ch][1:]
        else:
            return self._break()
        return ch

    def _string(self, ch: str) -> str | None:
        if self._escape:
            if ch not in _ESCAPES:
                return self._break()
            self._escape, self._hex = False, 4 if ch == "u" else 0
        elif self._hex:
            if ch not in _HEX:
                return self._break()
            self._hex -= 1
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            if self._key:
                self._state = "colon"
            else:
                self._end_value()
        elif ch < " ":  # JSON strings hold no raw control characters
            return self._break()
        return ch

    def _close(self, ch: str) -> str:
        self._stack.pop()
        self._end_value()
        return ch

    def _end_value(self) -> None:
        if self._stack:
            self._state = "after"
        else:
            self.done = True

    def _break(self) -> None:
        self.broken = True
        return None


class CallBlock:
    """The body of one ``<tool_call>`` block, read as it comes (see the module docstring)."""

    def __init__(self, names: Collection[str], first_index: int,
                 close: str | None = CLOSE_TAG) -> None:
        self.names = names
        self._close = close  # what ends the block (None: only the end of the output)
        self.raw = ""  # the body received; once the block is closed, the body alone
        self.started = 0  # calls started (their first delta sent)
        self._first = first_index
        self._state = "body"
        self._list = False  # the body is a list of calls
        self._scanner = JsonScanner()  # the key or value being read
        self._deltas: list[CallDelta] = []
        self._pieces: list[str] = []  # arguments read since the last delta
        self._broken_at = -1  # where in raw the JSON broke (then the block waits for its tag)
        self._tail_at = -1  # where in raw the closing tag began
        self._new_call()

    def _new_call(self) -> None:
        self._name: str | None = None
        self._key = ""
        self._value: list[str] = []  # a value's normalised text (one that is not streamed)
        self._arguments: str | None = None  # read but not yet sent (None: none yet)
        self._streaming = False  # the arguments are sent as they come

    def feed(self, text: str) -> str | None:
        """Read the next piece of the block's text; the text after its closing tag once the
        block has ended (the tag itself dropped), else None."""
        base = len(self.raw)
        self.raw += text
        for i, ch in enumerate(text):
            if self._state in ("broken", "closed"):
                break
            self._read(ch, base + i)
        if self._state == "broken" and self._close:
            start = self.raw.find(self._close, self._broken_at)
            if start >= 0:
                self._state, self._tail_at = "closed", start
        if self._state != "closed":
            return None
        rest = self.raw[self._tail_at + len(self._close or ""):]
        self.raw = self.raw[:self._tail_at]
        return rest

    @property
    def broken(self) -> bool:
        """The JSON broke off: the block now only waits for its closing tag."""
        return self._state == "broken"

    def take(self) -> list[CallDelta]:
        """The deltas read since the last call."""
        self._flush()
        deltas, self._deltas = self._deltas, []
        return deltas

    def _flush(self) -> None:
        if self._pieces:
            self._deltas.append(CallDelta(self._first + self.started - 1, None,
                                          "".join(self._pieces)))
            self._pieces = []

    def _break(self, at: int) -> None:
        self._state, self._broken_at = "broken", at

    def _read(self, ch: str, at: int) -> None:
        state = self._state
        if state in ("key", "value"):
            self._member(ch, at)
        elif state == "tail":
            tail = self.raw[self._tail_at:at + 1]
            if tail == self._close:
                self._state = "closed"
            elif not (self._close or "").startswith(tail):
                self._break(self._tail_at)
        elif ch in _WS:
            pass
        elif state == "body" and ch == "[":
            self._state, self._list = "first_call", True
        elif state in ("body", "first_call", "next_call") and ch == "{":
            self._state = "first_member"
        elif state == "after_call" and ch == ",":
            self._state = "next_call"
        elif state == "after_call" and ch == "]":
            self._state = "after_body"
        elif state == "after_body" and self._close and ch == self._close[0]:
            self._state, self._tail_at = "tail", at
        elif state in ("first_member", "member") and ch == '"':
            self._state, self._scanner = "key", JsonScanner()
            self._member(ch, at)
        elif state == "first_member" and ch == "}" or state == "after_member" and ch == "}":
            self._end_call(at)
        elif state == "after_member" and ch == ",":
            self._state = "member"
        elif state == "colon" and ch == ":":
            self._state = "value_start"
        elif state == "value_start":
            self._start_value(ch, at)
        else:
            self._break(at)

    def _member(self, ch: str, at: int) -> None:
        """A character of a member's key or value."""
        out = self._scanner.push(ch)
        if out:
            (self._pieces if self._streaming else self._value).append(out)
        if self._scanner.broken:
            self._break(at)
        elif self._scanner.done:
            if self._state == "key":
                self._key, self._state = json.loads("".join(self._value)), "colon"
                self._value = []
            else:
                self._end_value(at)
                if out is None and self._state != "broken":  # a number ended before ch
                    self._read(ch, at)

    def _start_value(self, ch: str, at: int) -> None:
        self._state, self._scanner, self._value = "value", JsonScanner(), []
        if (self._key in _ARGUMENT_KEYS and self._arguments is None and ch == "{"
                and self._name is not None):
            self._start_call()
            self._streaming = True
        self._member(ch, at)

    def _end_value(self, at: int) -> None:
        text, key = "".join(self._value), self._key
        self._state, self._value = "after_member", []
        if key == "name":
            name = json.loads(text)
            if self._name is not None or not isinstance(name, str) or name not in self.names:
                self._break(at)
            self._name = name
        elif key in _ARGUMENT_KEYS:
            if self._streaming:
                self._streaming, self._arguments = False, ""
            elif self._arguments is not None:
                self._break(at)  # arguments given twice
            else:
                self._arguments = _arguments_text(self._scanner.kind, text)
                if self._arguments is None:
                    self._break(at)

    def _end_call(self, at: int) -> None:
        if self._name is None:
            self._break(at)
            return
        if self._arguments != "":  # not streamed: the whole arguments at once
            self._start_call()
            self._pieces.append(self._arguments or "{}")
        self._flush()
        self._new_call()
        self._state = "after_call" if self._list else "after_body"

    def _start_call(self) -> None:
        self._flush()
        assert self._name is not None
        self._deltas.append(CallDelta(self._first + self.started, self._name, ""))
        self.started += 1


def _arguments_text(kind: str, text: str) -> str | None:
    """The arguments of an object read whole (its normalised text), or of a JSON text in a
    string (parsed and written by json.dumps); None for anything else."""
    if kind == "{":
        return text
    if kind != '"':
        return None
    try:
        args = loads_json(json.loads(text))
    except ValueError:
        return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None
