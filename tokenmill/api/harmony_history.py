"""Earlier tool calls and their results written back in gpt-oss's harmony, for a harmony chat
template that cannot write them itself (it knows no ``tool_calls`` or ``tool`` role).

gpt-oss's own template writes a call as its own message, ``<|start|>assistant
to=functions.NAME<|channel|>commentary json<|message|>{ARGS}<|call|>`` (the assistant's text
beside the calls before it, on the analysis channel), and a result as ``<|start|>functions.NAME
to=assistant<|channel|>commentary<|message|>"RESULT"<|end|>`` (the result as a JSON string).
Those markers are control tokens, which a message's content can never produce (the tokenizer
reads special-token text in the caller's messages as plain text). So the messages carry
stand-ins instead: plain text marked by a nonce the caller cannot guess, which the template
renders like any content. After rendering, ``expand`` replaces each message that holds
stand-ins, template header and ending included, by the harmony messages; the caller's text in
them (arguments, results, the assistant's text) stays the hidden plain text it was, so only
the markers written here become control tokens.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from typing import Any

START, CHANNEL, MESSAGE, END, CALL = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", \
    "<|call|>"
# What ends the message a template wrote around the stand-ins.
_ENDS = (END, "<|return|>", CALL)
# A function name harmony's header can carry (as the harmony reader reads it back).
_NAME = re.compile(r"[\w.-]+")


class HarmonyHistory:
    """The stand-ins of one request's earlier calls and results, and their expansion."""

    def __init__(self) -> None:
        self._nonce = secrets.token_hex(8)
        self._last_call: str | None = None  # a result with no known call answers this one
        mark = re.escape(f"\ue002{self._nonce}")
        self._item = re.compile(mark + r"([cr]):([\w.-]+)\ue003")
        self._close = f"\ue002{self._nonce}/\ue003"

    def _mark(self, kind: str, name: str) -> str:
        return f"\ue002{self._nonce}{kind}:{name}\ue003"

    def calls(self, calls: Iterable[tuple[str, Any]]) -> str:
        """The stand-in of an assistant turn's calls (``(name, arguments)`` pairs);
        ValueError for a name harmony cannot write."""
        out = []
        for name, arguments in calls:
            if not _NAME.fullmatch(name):
                raise ValueError(f"function name {name!r} must be letters, digits, '_', '.' "
                                 "or '-' (gpt-oss's harmony writes it in a message header)")
            out.append(self._mark("c", name) + json.dumps(arguments, ensure_ascii=False))
            self._last_call = name
        return "".join(out) + self._close

    def result(self, content: str, name: str | None) -> str:
        """The stand-in of a tool's result; ``name``: the function called (None: the last
        call written before it, as gpt-oss's template takes it). ValueError if there is none."""
        name = name or self._last_call
        if name is None or not _NAME.fullmatch(name):
            raise ValueError("a tool message must answer an earlier assistant tool call (its "
                             "tool_call_id): gpt-oss's harmony names the function a result "
                             "comes from")
        return self._mark("r", name) + json.dumps(content, ensure_ascii=False) + self._close

    def expand(self, rendered: str) -> str:
        """``rendered`` (the template's output, the caller's text in it hidden) with every
        message that holds stand-ins replaced by its harmony messages."""
        out, pos = [], 0
        while (first := self._item.search(rendered, pos)) is not None:
            at = first.start()
            start = rendered.rfind(START, pos, at)
            body = rendered.find(MESSAGE, start, at) if start >= 0 else -1
            # The caller's text is hidden: the first ending after a stand-in is the template's.
            ends = [(i, tag) for tag in _ENDS if (i := rendered.find(tag, at)) >= 0]
            if body < 0 or not ends:  # not inside a harmony message: written where it stands
                close = rendered.find(self._close, at)
                stop = close + len(self._close) if close >= 0 else len(rendered)
                out += [rendered[pos:at], self._messages("", rendered[at:stop])]
                pos = stop
                continue
            end, tag = min(ends)
            run = rendered[at:end]
            run = run[:run.rfind(self._close)] if self._close in run else run
            out += [rendered[pos:start],
                    self._messages(rendered[body + len(MESSAGE):at], run)]
            pos = end + len(tag)
        return "".join(out) + rendered[pos:]

    def _messages(self, preamble: str, items: str) -> str:
        """The harmony messages of a run of stand-ins, the text before them (the assistant's
        own, beside its calls) as an analysis message first."""
        parts = self._item.split(items.replace(self._close, ""))
        # split gives: text before the first mark, then (kind, name, body) per item.
        text = (preamble + parts[0]).strip()
        out = [f"{START}assistant{CHANNEL}analysis{MESSAGE}{text}{END}"] if text else []
        for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
            if kind == "c":
                out.append(f"{START}assistant to=functions.{name}{CHANNEL}commentary json"
                           f"{MESSAGE}{body.strip()}{CALL}")
            else:
                out.append(f"{START}functions.{name} to=assistant{CHANNEL}commentary"
                           f"{MESSAGE}{body.strip()}{END}")
        return "".join(out)
