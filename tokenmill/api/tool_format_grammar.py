"""The grammars that force a call in the formats that are not JSON (api/tool_formats_text.py):
Qwen3-Coder's ``<function=...>`` blocks and a pythonic list of calls. Each allows only the
request's functions and, as argument names, their schemas' properties; the values are free
text (Qwen3-Coder) or Python literals (pythonic), so what comes out is always read as a call,
though its values are not checked against the schema as the JSON formats' grammar does."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# A Python literal of the kinds that have a JSON form (escapes and numbers limited to what
# ast.literal_eval reads: no \x without its digits, no 01).
_PY_VALUES = r'''
py_value ::= py_string | py_number | "True" | "False" | "None" | py_list | py_dict
py_string ::= "\"" ([^"\\\n] | py_escape)* "\"" | "'" ([^'\\\n] | py_escape)* "'"
py_escape ::= "\\" ["'\\nt]
py_number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
py_list ::= "[" (py_value (", " py_value)*)? "]"
py_dict ::= "{" (py_string ": " py_value (", " py_string ": " py_value)*)? "}"
'''


def _properties(parameters: Mapping[str, Any] | None) -> list[str]:
    props = (parameters or {}).get("properties")
    return list(props) if isinstance(props, dict) else []


def _choice(names: list[str]) -> str:
    return " | ".join(json.dumps(n) for n in names)


def qwen3_coder_grammar(functions: Mapping[str, Mapping[str, Any] | None],
                        parallel: bool) -> str:
    """EBNF of one (or, ``parallel``, one or more) Qwen3-Coder call blocks."""
    rules, calls = [], []
    for i, (name, params) in enumerate(functions.items()):
        keys = _properties(params)
        head = json.dumps(f"<tool_call>\n<function={name}>\n")
        body = f" p{i}*" if keys else ""
        rules.append(f'f{i} ::= {head}{body} "</function>\\n</tool_call>"')
        if keys:
            rules.append(f'p{i} ::= "<parameter=" ({_choice(keys)}) ">\\n" [^<]* '
                         f'"\\n</parameter>\\n"')
        calls.append(f"f{i}")
    repeat = ' ("\\n" call)*' if parallel else ""
    return "\n".join([f"root ::= call{repeat}", f"call ::= {' | '.join(calls)}", *rules]) + "\n"


def pythonic_grammar(functions: Mapping[str, Mapping[str, Any] | None], parallel: bool) -> str:
    """EBNF of a Python list of one (or, ``parallel``, one or more) calls."""
    rules, calls = [], []
    for i, (name, params) in enumerate(functions.items()):
        keys = [k for k in _properties(params) if k.isidentifier()]
        args = f' (a{i} (", " a{i})*)?' if keys else ""
        rules.append(f"f{i} ::= {json.dumps(name + '(')}{args} \")\"")
        if keys:
            rules.append(f'a{i} ::= ({_choice(keys)}) "=" py_value')
        calls.append(f"f{i}")
    repeat = ' (", " call)*' if parallel else ""
    return "\n".join([f'root ::= "[" call{repeat} "]"', f"call ::= {' | '.join(calls)}",
                      *rules]) + _PY_VALUES


def checked_ebnf(ebnf: str) -> str:
    """``ebnf`` as xgrammar reads it back (so a grammar it cannot read fails here, a 400)."""
    import xgrammar  # imported on first use, as api/tool_grammar.py does

    try:
        return str(xgrammar.Grammar.from_ebnf(ebnf))
    except Exception as e:  # xgrammar raises RuntimeError on a bad grammar
        raise ValueError(f"the call grammar cannot be built: {e}") from None
