"""gpt-oss's tool calls in its harmony format: a message on the ``commentary`` channel
addressed to a function, its body the arguments' JSON, ended by ``<|call|>``:
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
(OpenAI's harmony guide writes calls so).

The harmony reasoning parser (api/reasoning_harmony.py) reads the model's messages and passes
such a call on as a ``<tool_call>`` block, so this format reads calls as Hermes does, and earlier
calls are written back the same way. What is its own is the grammar that forces a call: the
harmony header and the JSON body, never Hermes's ``<tool_call>`` text, which a gpt-oss model
would only write because a Hermes grammar made it. The grammar starts where the prompt leaves
the model: after ``<|start|>assistant`` (gpt-oss's generation prompt) the channel comes first;
inside a message the template opened (its prompt ends with ``<|message|>``), that message is
ended first. As for every output constraint (api/reasoning_request.py), the call is forced from
the first token: no analysis message comes before it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from tokenmill.api.harmony_history import HarmonyHistory
from tokenmill.api.tool_grammar import CallFrame, framed_call_grammar
from tokenmill.api.tool_parsers import HermesParser, ToolParser

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CONSTRAIN, CALL = "<|constrain|>", "<|call|>"
# One call's header up to its body; {name} stands for the function's name.
CALL_HEAD = f"{CHANNEL}commentary to=functions.{{name}} {CONSTRAIN}json{MESSAGE}"


def harmony_opening(prompt: str | None) -> str:
    """What the output writes before a call's channel, given the rendered prompt (None:
    gpt-oss's own, which ends with ``<|start|>assistant``): nothing there, the end of the
    message the prompt opened and a new header, or a new header."""
    text = (prompt or f"{START}assistant").rstrip()
    if text.endswith(f"{START}assistant"):
        return ""
    if text.endswith(MESSAGE):
        return f"{END}{START}assistant"
    return f"{START}assistant"


def harmony_call(name: str, arguments: Any) -> str:
    """One call as gpt-oss writes it (``arguments``: the JSON value)."""
    return CALL_HEAD.replace("{name}", name) + json.dumps(arguments, ensure_ascii=False) + CALL


class HarmonyToolParser(HermesParser):
    """gpt-oss (see the module docstring). Chosen by ``auto`` for a harmony chat template."""

    name = "gpt_oss"

    def __init__(self) -> None:
        # Earlier calls and results for a template that cannot write them: this request's.
        self._history = HarmonyHistory()

    def format_calls(self, calls: Iterable[tuple[str, Any]]) -> str:
        """Earlier calls, as stand-ins that ``expand_history`` turns into harmony messages
        (api/harmony_history.py); ValueError for a name harmony cannot write."""
        return self._history.calls(calls)

    def format_result(self, content: str, name: str | None = None) -> str:
        """A tool's result, as a stand-in for its harmony message (see ``format_calls``)."""
        return self._history.result(content, name)

    def expand_history(self, rendered: str) -> str:
        """The rendered prompt with the stand-ins written in harmony."""
        return self._history.expand(rendered)

    def forced_grammar(self, functions: Mapping[str, Mapping[str, Any] | None],
                       parallel: bool, prompt: str | None = None) -> str:
        """One call in harmony's shape (``<|call|>`` ends gpt-oss's turn: a model calls one
        function a turn, so ``parallel`` allows no more). gpt-oss's ``<|call|>`` is also a
        stop token, which a grammar cannot ask for: the call may end with it or with any
        other stop token (the reader closes a call cut there)."""
        frame = CallFrame(head=CALL_HEAD, open=harmony_opening(prompt), sep=None, close=CALL,
                          optional_close=True)
        return framed_call_grammar(frame, functions, parallel)

    def with_reasoning(self, reasoning_parser: str | None) -> ToolParser:
        """Itself behind the gpt_oss reasoning parser, which reads the messages; without it
        (``--reasoning-parser none``) harmony's markup cannot be read, so Hermes's format,
        whose forced ``<tool_call>`` text is read as it stands."""
        return self if reasoning_parser == "gpt_oss" else HermesParser()

    def system_prompt(self, functions: list[dict[str, Any]], must_call: str | None) -> str:
        """The tools and harmony's call shape, for a template that does not render tools."""
        listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
        example = harmony_call("<function-name>", {"<argument>": "<value>"})
        if must_call:
            rule = f"Answer with a call to the function {must_call}."
        elif must_call == "":
            rule = "Answer with a function call."
        else:
            rule = "Call a function when it helps to answer."
        return (f"# Tools\n\nYou can call these functions (JSON schemas of their arguments):\n"
                f"{listed}\n{rule} A call is a commentary message to the function, its body "
                f"the arguments as JSON:\n{example}")


def is_harmony_template(template: str) -> bool:
    """Whether a chat template writes harmony (as the gpt_oss reasoning parser's ``auto``
    reads it)."""
    return CHANNEL in template

