"""Per-request incremental detokenization and stop-string handling.

`IncrementalDetokenizer` turns each step's new token ids into new text at a constant cost per
token and never emits half a UTF-8 character. `StopChecker` sits behind it and decides which of
that text is safe to stream: it holds back a tail that could still become a stop string, and
cuts the output at the first stop string, even one spread over several tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded as context in front of the output, so the first output token gets the
# spacing it has in context (SentencePiece drops a leading space at the start of a decode).
_CONTEXT_TOKENS = 5
# Drop consumed ids from the window once this many have piled up (amortised O(1) per token).
_TRIM_AT = 64
_REPLACEMENT = "\ufffd"


class DecodingTokenizer(Protocol):
    """What the detokenizer needs from a tokenizer (tokenmill.tokenizer.Tokenizer has it)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        ...


class IncrementalDetokenizer:
    """Text of one sequence's output tokens, produced a step at a time.

    The prefix/read offset technique: decode the few tokens before the last emitted point
    (``prefix``) with and without the new tokens, and emit the difference. Decoding a short
    window keeps the cost per token constant, and the context tokens keep leading-space markers
    and byte-level merges right. While the window's text ends in U+FFFD the last token holds an
    incomplete UTF-8 character, so nothing is emitted until a later token completes it.
    """

    def __init__(self, tokenizer: DecodingTokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The window: a few prompt tokens, then the output tokens not yet behind prefix_offset.
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)  # ids before this are emitted as text
        self._prefix_offset = 0  # ids from here to read_offset are decoded as context
        self.num_output_tokens = 0

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Add one step's new token ids; returns the text they complete (possibly "")."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self.num_output_tokens += len(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Call once when the sequence has finished: the text still held back, without the
        trailing U+FFFD of a character the last tokens left incomplete (max_tokens may end
        the output between the bytes of an emoji: those bytes are not text)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset],
                             skip_special_tokens=skip)
        new_text = decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            # Nothing new yet (a special token being skipped, or half a character).
            return ""
        delta = new_text[len(prefix_text):]
        if final:
            delta = delta.rstrip(_REPLACEMENT)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta


class StopChecker:
    """Finds stop strings in a stream of text deltas and says what is safe to emit.

    `feed` returns the text that can go out now and the stop string matched, if any. Until a
    match is impossible, the tail of the text that is a prefix of some stop string is held
    back, so no character of a stop string ever reaches the stream unless
    ``include_stop_str_in_output``. When several stop strings occur, the one that is complete
    first in the text wins (on a tie, the longer one), which does not depend on how the text
    was split into deltas. After a match the output ends: later calls return ("", None).
    """

    def __init__(self, stop_strings: Sequence[str], include_stop_str_in_output: bool = False
                 ) -> None:
        for s in stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop_strings = list(stop_strings)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None
        self._held = ""
        # Every proper prefix of a stop string: a tail of the text equal to one of these could
        # still grow into that stop string.
        self._prefixes = {s[:i] for s in self.stop_strings for i in range(1, len(s))}
        self._max_hold = max((len(s) for s in self.stop_strings), default=1) - 1

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched."""
        return self.matched is not None

    def feed(self, delta: str, final: bool = False) -> tuple[str, str | None]:
        """Add new text. Returns (text safe to emit now, the stop string matched or None).

        ``final=True`` means the sequence ends for another reason: held-back text is flushed.
        """
        if self.matched is not None:
            return "", None
        if not self.stop_strings:
            return delta, None
        text = self._held + delta
        match = self._find(text)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            end = start + len(stop) if self.include_stop_str_in_output else start
            return text[:end], stop
        hold = 0 if final else self._hold_length(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], None

    def _find(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop): smallest wins
        for stop in self.stop_strings:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _hold_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is the start of some stop string."""
        for k in range(min(len(text), self._max_hold), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0
