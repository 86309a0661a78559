"""Tool-call formats that are not JSON, read as vLLM's parsers of the same names read them:

- ``qwen3_coder`` (Qwen3-Coder): ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n
  </parameter>\\n...</function>\\n</tool_call>``. A value is typed by the tool's JSON schema:
  a string stays the text, numbers, booleans, objects and arrays are parsed (a value that does
  not parse as its type stays a string, as does one the schema does not name).
- ``pythonic`` (Llama 3.2 / 4's pythonic templates): the output is a Python list of calls,
  ``[get_weather(city="Paris"), ping()]``, keyword arguments holding literals only. Each value
  is read with ``ast.literal_eval``, never evaluated.

The arguments stream as JSON, one argument at a time as each one's value ends:
``{"city": "Paris"`` then ``, "days": 3`` then ``}``. See api/tool_formats.py for the rest.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Collection, Mapping
from typing import Any

from tokenmill.api.tool_format_grammar import checked_ebnf, pythonic_grammar, qwen3_coder_grammar
from tokenmill.api.tool_formats import FormatStream
from tokenmill.api.tool_json import CallDelta
from tokenmill.api.tool_parsers import OPEN_TAG, CallFormat, ToolParser

FUNCTION, PARAMETER = "<function=", "<parameter="
END_PARAMETER, END_FUNCTION, END_CALL = "</parameter>", "</function>", "</tool_call>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_HEADER = re.compile(r"<(?:function|parameter)=([^>\n]*)>")
_MAX_HEADER = 80  # a header longer than a name allows is not one
_CALLABLE = re.compile(r"[A-Za-z_][\w.-]*")


class _Calls:
    """What the readers share: the calls started and ended, their deltas and pieces."""

    def __init__(self, names: Collection[str], first_index: int) -> None:
        self.raw, self.started, self.ended = "", 0, 0
        self.names, self.first = names, first_index
        self._deltas: list[CallDelta] = []
        self._pieces: list[str] = []
        self._arguments = 0  # arguments written of the current call

    def _start(self, name: str) -> None:
        self._flush()  # the previous call's last piece
        self._deltas.append(CallDelta(self.first + self.started, name, ""))
        self.started += 1
        self._arguments = 0
        self._pieces.append("{")

    def _argument(self, key: str, value_json: str) -> None:
        sep = ", " if self._arguments else ""
        self._pieces.append(f"{sep}{json.dumps(key, ensure_ascii=False)}: {value_json}")
        self._arguments += 1

    def _end(self) -> None:
        self._pieces.append("}")
        self.ended = self.started

    def _flush(self) -> None:
        if self._pieces:
            self._deltas.append(CallDelta(self.first + self.started - 1, None,
                                          "".join(self._pieces)))
            self._pieces = []

    def take(self) -> list[CallDelta]:
        self._flush()
        deltas, self._deltas = self._deltas, []
        return deltas


def typed_value(text: str, schema: Any) -> str:
    """``text`` as the JSON value ``schema`` (an argument's JSON schema) types it; a string
    when it does not parse as any of the schema's types."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = types if isinstance(types, list) else [types] if types else []
    bare = text.strip()
    for kind in types:
        if kind == "string":
            return json.dumps(text, ensure_ascii=False)
        if kind == "null" and bare.lower() in ("null", "none"):
            return "null"
        if kind == "boolean" and bare.lower() in ("true", "false"):
            return bare.lower()
        if kind in ("integer", "number", "object", "array"):
            value = _literal(bare)
            if kind == "integer" and type(value) is int or kind == "number" and \
                    type(value) in (int, float) or kind == "object" and \
                    isinstance(value, dict) or kind == "array" and isinstance(value, list):
                return json.dumps(value, ensure_ascii=False)
    return json.dumps(text, ensure_ascii=False)


def _literal(text: str) -> Any:
    """A JSON or Python literal's value; None when it is neither (or has no JSON form)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value)
        return value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


class Qwen3CoderReader(_Calls):
    """One ``<tool_call>`` block of Qwen3-Coder's (see the module docstring)."""

    def __init__(self, names: Collection[str], first_index: int,
                 schemas: Mapping[str, Any]) -> None:
        super().__init__(names, first_index)
        self._schemas = schemas
        self._properties: dict[str, Any] = {}
        self._state = "function"  # "function", "parameters", "value", "close"
        self._key = ""
        self._buf = ""

    def feed(self, text: str) -> str | None:
        self.raw += text
        self._buf += text
        rest = self._read()
        if rest is not None:
            self.raw = self.raw[:len(self.raw) - len(rest)]
        return rest

    def _read(self) -> str | None:
        while True:
            body = self._buf.lstrip()
            if self._state == "function":
                header = self._header(body, FUNCTION)
                if header is None:
                    return None
                name = header.group(1).strip() if header else ""
                if name not in self.names:
                    return ""  # not a call: the block is content
                self._start(name)
                props = (self._schemas.get(name) or {}).get("properties")
                self._properties = props if isinstance(props, dict) else {}
                self._state, self._buf = "parameters", body[header.end():]
            elif self._state == "parameters":
                if END_FUNCTION.startswith(body) and body != END_FUNCTION:
                    return None
                if body.startswith(END_FUNCTION) or not END_FUNCTION.startswith(body) and \
                        not body.startswith(PARAMETER) and not PARAMETER.startswith(body):
                    self._end()  # a missing </function> ends the call all the same
                    self._state = "close"
                    self._buf = body.removeprefix(END_FUNCTION)
                    continue
                header = self._header(body, PARAMETER)
                if header is None:
                    return None
                if not header:
                    self._end()
                    self._state = "close"
                    continue
                self._key, self._state = header.group(1).strip(), "value"
                self._buf = body[header.end():]
            elif self._state == "value":
                ends = [(at, tag) for tag in (END_PARAMETER, PARAMETER, END_FUNCTION)
                        if (at := self._buf.find(tag)) >= 0]
                if not ends:
                    return None
                at, tag = min(ends)
                self._value(self._buf[:at])
                self._state = "parameters"
                self._buf = self._buf[at + (len(tag) if tag == END_PARAMETER else 0):]
            elif body.startswith(END_CALL):
                return body[len(END_CALL):]
            elif END_CALL.startswith(body):
                return None
            else:
                return self._buf

    @staticmethod
    def _header(body: str, tag: str) -> re.Match[str] | None | bool:
        """The header ``tag...>`` at the start of ``body``; None while it may still come,
        False when it cannot."""
        if tag.startswith(body):
            return None
        if not body.startswith(tag):
            return False
        match = _HEADER.match(body)
        if match is None:
            return None if ">" not in body and "\n" not in body and \
                len(body) <= _MAX_HEADER else False
        return match

    def _value(self, text: str) -> None:
        # The template puts the value on lines of its own.
        text = text.removeprefix("\n").removesuffix("\n")
        self._argument(self._key, typed_value(text, self._properties.get(self._key)))

    def finish(self) -> None:
        # Cut short: the call keeps the arguments written so far, as valid JSON.
        if self.started > self.ended:
            if self._state == "value" and self._buf:
                self._value(self._buf)
            self._end()


class PythonicReader(_Calls):
    """A Python list of calls (see the module docstring), read a character at a time."""

    def __init__(self, names: Collection[str], first_index: int) -> None:
        super().__init__(names, first_index)
        self._state = "open"  # "open", "name", "arguments", "after", "dropped"
        self._name = ""
        self._pending = ""  # the call read up to "(", not started yet
        self._arg = ""  # the text of the argument being read
        self._depth = 0  # brackets open inside it
        self._quote = ""  # the string it is inside, by its quote ("" outside)
        self._quote_at = 0
        self._escape = False
        self._pair = ""  # a string that just closed as a pair of quotes: maybe '''/"""

    def feed(self, text: str) -> str | None:
        self.raw += text
        for i, ch in enumerate(text):
            rest = self._read(ch, text[i + 1:])
            if rest is not None:
                if self._state == "done":
                    rest = rest.removeprefix(PYTHON_END)
                self.raw = self.raw[:len(self.raw) - len(rest)]
                return rest
        return None

    def _read(self, ch: str, after: str) -> str | None:
        """Read ``ch`` (``after``: the rest of the piece); the rest once the list ended."""
        state = self._state
        if state == "arguments":
            return self._argument_char(ch)
        elif state == "dropped":
            pass
        elif ch.isspace():
            if state == "name" and self._name:
                self._name += ch
        elif state == "open":
            if ch != "[":
                return ""  # not a list: content
            self._state = "name"
        elif state == "name":
            if ch != "(":
                self._name += ch
                if not _CALLABLE.fullmatch(self._name.strip()) or len(self._name) > 64:
                    return self._stop()
                return None
            name, self._name = self._name.strip(), ""
            if name not in self.names:
                return self._stop()
            # The call starts once its first argument reads well (or it has none), so a
            # call whose arguments are not literals is all content.
            self._pending = name
            self._state = "arguments"
        elif state == "after" and ch == ",":
            self._state = "name"
        elif state == "after" and ch == "]":
            self._state = "done"
            return after
        else:
            return ch + after
        return None

    def _stop(self) -> str | None:
        """Not a call: before any call, all of the text is content; after one, the rest
        (the unreadable call included) is dropped."""
        if not self.started:
            return ""
        self._state = "dropped"
        return None

    def _argument_char(self, ch: str) -> str | None:
        if self._pair:
            pair, self._pair = self._pair, ""
            if ch == pair:  # '' then ': a triple-quoted string opens
                self._quote, self._quote_at = pair * 3, len(self._arg) - 2
                self._arg += ch
                return None
        if self._quote:
            self._arg += ch
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif self._arg.endswith(self._quote) and \
                    len(self._arg) - self._quote_at >= 2 * len(self._quote):
                if len(self._arg) - self._quote_at == 2:
                    self._pair = ch
                self._quote = ""
            return None
        if ch in "'\"":
            self._quote, self._quote_at = ch, len(self._arg)
        elif ch in "([{":
            self._depth += 1
        elif ch in ")]}" and self._depth:
            self._depth -= 1
        elif ch in ",)" and not self._depth:
            if not self._end_argument(last=ch == ")"):
                if self._pending:
                    self._pending = ""
                else:
                    self._end()
                return self._stop()
            if ch == ")":
                self._open_call()
                self._end()
                self._state = "after"
            return None
        self._arg += ch
        return None

    def _open_call(self) -> None:
        if self._pending:
            self._start(self._pending)
            self._pending = ""

    def _end_argument(self, last: bool) -> bool:
        """Write the argument read; False when it is not ``key=literal``."""
        text, self._arg = self._arg.strip(), ""
        if not text:
            return last  # f() or f(a=1, ): nothing to write
        key, eq, value = text.partition("=")
        literal = _python_literal(value.strip()) if eq and key.strip().isidentifier() else None
        if literal is None:
            return False
        self._open_call()
        self._argument(key.strip(), literal)
        return True

    def finish(self) -> None:
        if self.started > self.ended:
            self._end()


def _python_literal(text: str) -> str | None:
    """A Python literal's value as JSON text (``true``/``false``/``null`` read too); None
    for anything else."""
    if text in ("true", "false", "null"):
        return text
    try:
        return json.dumps(ast.literal_eval(text), ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


class Qwen3CoderParser(ToolParser):
    """Qwen3-Coder's XML-like calls (see the module docstring)."""

    name = "qwen3_coder"
    format = CallFormat(open=f"{OPEN_TAG}\n", sep=f"\n{END_CALL}\n{OPEN_TAG}\n",
                        close=f"\n{END_CALL}")

    def stream(self, names: Collection[str],
               schemas: Mapping[str, Any] | None = None) -> FormatStream:
        return FormatStream(OPEN_TAG, "",
                            lambda first: Qwen3CoderReader(names, first, schemas or {}))

    def forced_grammar(self, functions: Mapping[str, Mapping[str, Any] | None],
                       parallel: bool, prompt: str | None = None) -> str:
        return checked_ebnf(qwen3_coder_grammar(functions, parallel))

    def format_calls(self, calls: Any) -> str:
        return "\n".join(f"{OPEN_TAG}\n{_xml_call(n, a)}\n{END_CALL}" for n, a in calls)


def _xml_call(name: str, arguments: Any) -> str:
    params = "".join(
        f"{PARAMETER}{k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
        f"\n{END_PARAMETER}\n" for k, v in (arguments if isinstance(arguments, dict) else {})
        .items())
    return f"{FUNCTION}{name}>\n{params}{END_FUNCTION}"


class PythonicParser(ToolParser):
    """A Python list of calls (see the module docstring)."""

    name = "pythonic"
    format = CallFormat(open="[", sep=", ", close="]")

    def stream(self, names: Collection[str],
               schemas: Mapping[str, Any] | None = None) -> FormatStream:
        return FormatStream(PYTHON_START, "[", lambda first: PythonicReader(names, first))

    def forced_grammar(self, functions: Mapping[str, Mapping[str, Any] | None],
                       parallel: bool, prompt: str | None = None) -> str:
        return checked_ebnf(pythonic_grammar(functions, parallel))

    def format_calls(self, calls: Any) -> str:
        return "[" + ", ".join(_python_call(n, a) for n, a in calls) + "]"


def _python_call(name: str, arguments: Any) -> str:
    args = arguments if isinstance(arguments, dict) else {}
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
