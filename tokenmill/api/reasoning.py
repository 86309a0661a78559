"""Reasoning models' thinking: the parsers that split it from the answer, and the budget.

Qwen3, QwQ and DeepSeek-R1 write their thinking between ``<think>`` and ``</think>``, then
the answer. A chat template may open the thinking itself (its generation prompt ends with
``<think>``: DeepSeek-R1's, Qwen3-Thinking's), else the model opens it as its first words, or
does not think at all (Qwen3 with ``enable_thinking: false``, whose template writes an empty
``<think></think>`` into the prompt). ``ReasoningStream`` reads an output as it is generated:
the thinking goes to ``reasoning``, the rest to ``content``; a whole output is read by feeding
it in one piece, so the streamed and the whole answer agree.

The budget (``ThinkingBudget``, enforced by the sampler) needs the markers as single tokens of
the model's vocabulary, as reasoning models have them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import REASONING_PARSERS
from tokenmill.sampling_params import ThinkingBudget
from tokenmill.tokenizer import Tokenizer


@dataclass(frozen=True)
class ReasoningParser:
    """A family's thinking markup. ``transition``: the text forced when the budget is spent
    (it holds ``end``, the marker the model itself would write)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    transition: str = "\n</think>\n\n"
    # The markers are special tokens (harmony's): the output's text must keep them.
    special_markup: bool = False

    def start_tokens(self) -> tuple[str, ...]:
        """The vocabulary entries the start marker is written with."""
        return (self.start,)

    def starts_inside(self, prompt: str) -> bool:
        """Whether ``prompt`` (the rendered chat) leaves the model inside its thinking."""
        return prompt.rstrip().endswith(self.start)

    def stream(self, inside: bool) -> ReasoningStream:
        """A reader of one output sequence; ``inside``: see :meth:`starts_inside`."""
        return ReasoningStream(self, inside)

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        """A whole output's thinking (None when it has none) and its answer."""
        stream = self.stream(inside)
        reasoning, content = stream.feed(text)
        more = stream.finish()
        reasoning += more[0]
        return (reasoning if stream.thought else None), content + more[1]


PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1"),
}


def resolve_reasoning_parser(name: str, chat_template: str | None) -> ReasoningParser | None:
    """The parser ``name`` names (None for ``none``); ``auto``: by the chat template, which
    writes ``<think>`` for Qwen3/QwQ and DeepSeek-R1 (the same markup) and harmony's
    ``<|channel|>`` for gpt-oss (api/reasoning_harmony.py), else no parser."""
    if name == "none":
        return None
    if name == "gpt_oss" or (name == "auto" and "<|channel|>" in (chat_template or "")):
        from tokenmill.api.reasoning_harmony import HARMONY

        return HARMONY
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {name!r}")
        return PARSERS[name]
    template = chat_template or ""
    if "<think>" not in template and "</think>" not in template:
        return None
    return PARSERS["deepseek_r1" if "\uff5cAssistant\uff5c" in template else "qwen3"]


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    at = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while at >= 0:  # most pieces hold no "<" near their end: one find, no slicing
        if tag.startswith(text[at:]):
            return len(text) - at
        at = text.find(tag[0], at + 1)
    return 0


@dataclass
class ReasoningStream:
    """Reads one output sequence's text as it comes (see the module docstring). Whitespace
    at the start of the thinking and of the answer after it is dropped."""

    parser: ReasoningParser
    inside: bool
    thought: bool = False  # some thinking was opened
    _buf: str = ""  # text not yet passed on (it may be part of a marker)
    _opening: bool = True  # the output may still open its thinking
    _trim: bool = False  # drop the whitespace that starts the next part

    def __post_init__(self) -> None:
        if self.inside:
            self.thought, self._opening, self._trim = True, False, True

    def feed(self, text: str) -> tuple[str, str]:
        """The ``(reasoning, content)`` that ``text`` (the next piece) makes known."""
        self._buf += text
        reasoning = content = ""
        while self._buf:
            if self._trim:
                self._buf = self._buf.lstrip()
                self._trim = not self._buf
                continue
            if self.inside:
                done, piece = self._until(self.parser.end)
                reasoning += piece
                if not done:
                    break
                self.inside, self._trim = False, True
            elif self._opening:
                head = self._buf.lstrip()
                if head.startswith(self.parser.start):
                    self._buf = head[len(self.parser.start):]
                    self.inside = self.thought = self._trim = True
                    self._opening = False
                elif self.parser.start.startswith(head):
                    break  # may still become the start marker
                else:
                    self._opening = False
            else:
                content += self._buf
                self._buf = ""
        return reasoning, content

    def _until(self, tag: str) -> tuple[bool, str]:
        """The buffered text before ``tag`` (True: the tag was found and consumed), holding
        back what may begin it and the whitespace that may precede it (dropped if it does)."""
        at = self._buf.find(tag)
        if at >= 0:
            piece, self._buf = self._buf[:at], self._buf[at + len(tag):]
            return True, piece.rstrip()
        cut = len(self._buf) - _partial_tag_len(self._buf, tag)
        cut = len(self._buf[:cut].rstrip())
        piece, self._buf = self._buf[:cut], self._buf[cut:]
        return False, piece

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the sequence."""
        rest, self._buf = self._buf, ""
        if self.inside:
            return rest.rstrip(), ""
        return "", rest if not self._trim else rest.lstrip()


@dataclass
class ReasoningReader:
    """Reads a request's outputs for thinking: whole (``split``) or streamed (``delta``, one
    ReasoningStream per output sequence), and counts the thinking tokens."""

    parser: ReasoningParser
    inside: bool  # the prompt left the model inside its thinking
    start_ids: tuple[int, ...] | None  # the start marker's token ids (None: not tokens)
    end_id: int | None  # the end marker's token id (None: not a single token)
    streams: dict[int, ReasoningStream] = field(default_factory=dict)
    # Per sequence, the thinking tokens counted so far in a stream, and whether it is inside.
    _counts: dict[int, list[Any]] = field(default_factory=dict)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output's thinking (None without any) and answer."""
        return self.parser.split(text, self.inside)

    def delta(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """Sequence ``index``'s next piece of text as ``(reasoning, content)``."""
        stream = self.streams.setdefault(index, self.parser.stream(self.inside))
        reasoning, content = stream.feed(text)
        if finished:
            more = stream.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        return reasoning, content

    def count(self, token_ids: Sequence[int]) -> int:
        """The thinking tokens of a whole output (its markers included)."""
        state: list[Any] = [0, self.inside, []]
        self._count_into(state, token_ids)
        return state[0]

    def observe(self, index: int, token_ids: Sequence[int]) -> None:
        """Count the thinking tokens of sequence ``index``'s next streamed tokens."""
        self._count_into(self._counts.setdefault(index, [0, self.inside, []]), token_ids)

    @property
    def streamed_count(self) -> int:
        """The thinking tokens of every streamed sequence so far."""
        return sum(c[0] for c in self._counts.values())

    def _count_into(self, state: list[Any], token_ids: Sequence[int]) -> None:
        """``state``: [thinking tokens, inside, the last tokens outside]."""
        start, end = self.start_ids, self.end_id
        if not start or end is None:
            return
        for token in token_ids:
            if state[1]:
                state[0] += 1
                state[1] = token != end
                continue
            state[2] = (state[2] + [token])[-len(start):]
            if tuple(state[2]) == start:
                state[0] += len(start)
                state[1], state[2] = True, []


def marker_ids(parser: ReasoningParser, tokenizer: Tokenizer,
               ) -> tuple[tuple[int, ...] | None, int | None]:
    """The token ids of the start marker (None unless each of its markup tokens is one of the
    vocabulary's) and of the end marker (None unless it is a single token)."""
    ids = []
    for token in parser.start_tokens():
        ids.append(tokenizer.token_to_id(token))
    start = None if None in ids else tuple(i for i in ids if i is not None)
    return start, tokenizer.token_to_id(parser.end)


def reasoning_reader(parser: ReasoningParser, prompt: str, tokenizer: Tokenizer,
                     ) -> ReasoningReader:
    """The reader of a request whose rendered prompt is ``prompt``."""
    return ReasoningReader(parser, parser.starts_inside(prompt), *marker_ids(parser, tokenizer))


def thinking_budget(parser: ReasoningParser, tokenizer: Tokenizer, max_tokens: int,
                    inside: bool) -> ThinkingBudget:
    """The sampler's budget of ``max_tokens`` thinking tokens; ValueError when the model's
    vocabulary has no single-token markers to count and end the thinking with."""
    start, end = marker_ids(parser, tokenizer)
    if start is None or end is None:
        raise ValueError(f"the model's tokenizer has no {parser.start} / {parser.end} tokens: "
                         "its thinking cannot be counted")
    forced = tokenizer.encode(parser.transition, add_special_tokens=False)
    if end not in forced:
        forced = [end]
    return ThinkingBudget(max_tokens, start, end, tuple(forced), inside)


@dataclass(frozen=True)
class ReasoningSetup:
    """The server's reasoning settings: ``parser`` (one of REASONING_PARSERS) and the default
    thinking budget of a request that sets none (None: unbounded)."""

    parser: str = "auto"
    max_thinking_tokens: int | None = None
