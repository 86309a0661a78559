"""The grammar that makes a forced tool call always parse: the format's literal markup around
``{"name": "<a function>", "arguments": <JSON matching that function's parameters>}``, built
with xgrammar and handed to the engine as EBNF text (``StructuredOutputsParams.grammar``)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.api.tool_parsers import CallFormat
from tokenmill.structured.compiler import check_schema

if TYPE_CHECKING:
    import xgrammar

# "[17:38:21] /project/cpp/json_schema_converter.cc:4944: " before xgrammar's messages.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Tool sets whose grammar text is kept (a few kilobytes each).
GRAMMAR_CACHE_SIZE = 256
# The rule that repeats the calls; a name no xgrammar-generated rule uses.
_CALLS_RULE = "tokenmill_tool_calls"


def _grammar() -> type[xgrammar.Grammar]:
    # Imported on first use: xgrammar pulls in transformers, seconds a server without tool
    # calls need not spend.
    import xgrammar

    return xgrammar.Grammar


def _literal(text: str) -> xgrammar.Grammar:
    """A grammar of exactly ``text`` (a JSON string literal is a valid EBNF literal)."""
    return _grammar().from_ebnf(f"root ::= {json.dumps(text)}")


def arguments_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """The schema a call's arguments must match: the function's parameters, always an object
    (no parameters: the empty object, as OpenAI reads a function without them)."""
    schema = dict(parameters) if parameters else {"properties": {}}
    schema.setdefault("type", "object")
    return schema


def arguments_grammar(parameters: Mapping[str, Any] | None) -> xgrammar.Grammar:
    """The arguments of one function, as compact JSON. Strict: properties the schema does not
    name are not generated, so what comes out validates against the schema as given.
    ValueError (naming no field) if xgrammar cannot read the schema."""
    schema = arguments_schema(parameters)
    check_schema(schema, "parameters")  # names a bound too big or a $ref to elsewhere
    try:
        return _grammar().from_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=True)
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError on bad schemas
        raise ValueError(f"the parameters schema cannot be used: {_message(e)}") from None


def _message(e: Exception) -> str:
    """xgrammar's message without the timestamp and C++ source location it starts with."""
    return _XGRAMMAR_PREFIX.sub("", str(e)).strip()


def call_grammar(name: str, parameters: Mapping[str, Any] | None) -> xgrammar.Grammar:
    """One call, ``{"name": "<name>", "arguments": <arguments>}``, as the parsers read it."""
    head = '{"name": ' + json.dumps(name) + ', "arguments": '
    return _grammar().concat(_literal(head), arguments_grammar(parameters), _literal("}"))


def tool_call_grammar(fmt: CallFormat, functions: Mapping[str, Mapping[str, Any] | None],
                      parallel: bool) -> str:
    """EBNF of a turn of calls in ``fmt``: each call to one of ``functions`` (name ->
    parameters schema), one call, or one or more when ``parallel``. ValueError naming the
    function whose schema xgrammar cannot read. Cached: an agent sends the same tools with
    every request. (Keys keep their order: xgrammar writes properties in the schema's.)"""
    return _tool_call_grammar(fmt, json.dumps(functions, ensure_ascii=False), parallel)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _tool_call_grammar(fmt: CallFormat, functions_json: str, parallel: bool) -> str:
    functions: dict[str, Any] = json.loads(functions_json)
    calls = []
    for name, params in functions.items():
        try:
            calls.append(call_grammar(name, params))
        except ValueError as e:
            raise ValueError(f"function {name!r}: {e}") from None
    one = _grammar().union(*calls)
    # str() names the union's start rule "root"; the new start repeats it.
    repeat = f" ({json.dumps(fmt.sep)} root)*" if parallel else ""
    ebnf = (f"{one}\n{_CALLS_RULE} ::= {json.dumps(fmt.open)} root{repeat} "
            f"{json.dumps(fmt.close)}\n")
    return str(_grammar().from_ebnf(ebnf, root_rule_name=_CALLS_RULE))


@dataclass(frozen=True)
class CallFrame:
    """A format whose calls are not a JSON object: each call is ``head`` (``{name}`` stands
    for the function's name), the arguments' JSON, then ``tail``; a turn is ``open``, the
    calls separated by ``sep`` (None: one call only, whatever ``parallel`` says), ``close``.
    Mistral's ``[TOOL_CALLS]NAME[ARGS]{...}``, harmony's commentary messages."""

    head: str
    tail: str = ""
    open: str = ""
    sep: str | None = ""
    close: str = ""
    # The close may be left out: it is also a stop token, which ends the output in its place.
    optional_close: bool = False


def framed_call_grammar(frame: CallFrame, functions: Mapping[str, Mapping[str, Any] | None],
                        parallel: bool) -> str:
    """EBNF of a turn of calls framed by ``frame`` (see tool_call_grammar; cached too)."""
    return _framed_call_grammar(frame, json.dumps(functions, ensure_ascii=False), parallel)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _framed_call_grammar(frame: CallFrame, functions_json: str, parallel: bool) -> str:
    functions: dict[str, Any] = json.loads(functions_json)
    calls = []
    for name, params in functions.items():
        try:
            args = arguments_grammar(params)
        except ValueError as e:
            raise ValueError(f"function {name!r}: {e}") from None
        parts = [_literal(frame.head.replace("{name}", name)), args]
        calls.append(_grammar().concat(*parts, *([_literal(frame.tail)] if frame.tail else [])))
    one = _grammar().union(*calls)
    repeat = f" ({json.dumps(frame.sep)} root)*" if parallel and frame.sep is not None else ""
    close = f"({json.dumps(frame.close)})?" if frame.optional_close else json.dumps(frame.close)
    ebnf = f"{one}\n{_CALLS_RULE} ::= {json.dumps(frame.open)} root{repeat} {close}\n"
    return str(_grammar().from_ebnf(ebnf, root_rule_name=_CALLS_RULE))
