"""gpt-oss's harmony format: its answer is a series of messages, each a header
(``<|start|>assistant<|channel|>NAME`` and maybe ``to=...``) then ``<|message|>`` and a body
that ends with ``<|end|>`` (the turn goes on), ``<|return|>`` or ``<|call|>`` (the turn ends).
The ``analysis`` channel is the thinking; ``final`` (and ``commentary`` preambles) the answer.

The markers are special tokens, so a request read by this parser keeps special tokens in its
text (``skip_special_tokens`` off) and the parser takes them out. A message to a function
(``to=functions.NAME`` in its header, its body the arguments' JSON, ended by ``<|call|>``) is
passed on as the content ``<tool_call>{"name": NAME, "arguments": BODY}</tool_call>``, which
the tool-call reader (api/tool_parsers.py) reads as it reads any model's calls, arguments
streamed as they come.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenmill.api.reasoning import ReasoningParser, ReasoningStream, _partial_tag_len

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
# What ends a message's body: the turn goes on, ends, ends in a call; or a new header.
_BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", START)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_MARKUP = re.compile(r"<\|[a-z_]+\|>")
_RECIPIENT = re.compile(r"to=functions\.([\w.-]+)")


@dataclass(frozen=True)
class HarmonyParser(ReasoningParser):
    """gpt-oss: the analysis channel is the thinking (see the module docstring)."""

    name: str = "gpt_oss"
    start: str = f"{CHANNEL}analysis{MESSAGE}"
    end: str = "<|end|>"
    transition: str = f"<|end|>{START}assistant{CHANNEL}final{MESSAGE}"
    special_markup: bool = True

    def start_tokens(self) -> tuple[str, ...]:
        return (CHANNEL, "analysis", MESSAGE)

    def stream(self, inside: bool) -> ReasoningStream:
        return HarmonyStream(self, inside)


@dataclass
class HarmonyStream(ReasoningStream):
    """One output's messages, read as they come: analysis bodies to ``reasoning``, the
    others to ``content``, headers and markers dropped."""

    _header: bool = True  # reading a header (up to <|message|>)
    _call: bool = False  # the body is a function call's arguments
    _call_body: bool = False  # some of them were passed on

    def __post_init__(self) -> None:
        if self.inside:  # the prompt opened the analysis message
            self.thought, self._header = True, False

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        while self._buf:
            if self._header:
                at = self._buf.find(MESSAGE)
                if at < 0:
                    break
                header = self._buf[:at]
                name, to = _CHANNEL_NAME.search(header), _RECIPIENT.search(header)
                self.inside = name is not None and name.group(1) == "analysis" and to is None
                self.thought = self.thought or self.inside
                self._buf, self._header = self._buf[at + len(MESSAGE):], False
                self._call, self._call_body = to is not None, False
                if to is not None:
                    content += f'<tool_call>{{"name": {json.dumps(to.group(1))}, "arguments": '
                continue
            ends = [(i, tag) for tag in _BODY_ENDS if (i := self._buf.find(tag)) >= 0]
            if ends:
                at, tag = min(ends)
                piece = self._buf[:at]
                self._buf = self._buf[at + (0 if tag == START else len(tag)):]
                self._header = True
            else:
                keep = max(_partial_tag_len(self._buf, tag) for tag in _BODY_ENDS)
                piece, self._buf = self._buf[:len(self._buf) - keep], \
                    self._buf[len(self._buf) - keep:]
            if self.inside:
                reasoning += piece
            else:
                content += piece
                self._call_body = self._call_body or bool(piece.strip())
            if ends and self._call:
                content += self._end_call()
            if not ends:
                break
        return reasoning, content

    def _end_call(self) -> str:
        self._call = False
        return ("" if self._call_body else "{}") + "}</tool_call>"

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._call and not self._header:  # cut short: the reader keeps what it has
            return "", rest + self._end_call()
        if self._header:  # a header that never reached its body: any plain text is content
            return "", _MARKUP.sub("", rest).strip() if MESSAGE not in rest and \
                CHANNEL not in rest else ""
        return (rest, "") if self.inside else ("", rest)


HARMONY = HarmonyParser()
