"""Special tokens kept in the text for a tool-call format whose markup is special tokens
(Mistral's ``[TOOL_CALLS]`` and ``[ARGS]``), and hidden from the content the client sees.

With ``skip_special_tokens`` on (every request's default) the detokenizer would drop the
markup, and ``[TOOL_CALLS]get_weather[ARGS]{...}`` would read as the text
``get_weather{...}``. So such a request's output keeps special tokens, the tool reader reads
the calls, and ``HiddenTokens`` takes every special token's text out of what is left, as the
detokenizer would have: the content reads the same as without tools.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

from tokenmill.tokenizer import Tokenizer


@dataclass
class HiddenTokens:
    """The text of a vocabulary's special tokens, taken out of content, whole or streamed."""

    texts: frozenset[str]
    _pattern: re.Pattern[str] = field(init=False)
    _prefixes: frozenset[str] = field(init=False)  # proper starts of a token's text
    _longest: int = field(init=False)
    _held: dict[int, str] = field(default_factory=dict)  # per sequence: a token's start

    def __post_init__(self) -> None:
        self._pattern = re.compile("|".join(map(re.escape, sorted(self.texts, key=len,
                                                                  reverse=True))))
        self._prefixes = frozenset(t[:k] for t in self.texts for k in range(1, len(t)))
        self._longest = max(map(len, self.texts))

    def visible(self, text: str) -> str:
        """``text`` without the special tokens' text."""
        return self._pattern.sub("", text)

    def piece(self, index: int, text: str, finished: bool) -> str:
        """The visible part of sequence ``index``'s next piece of content: a token's text
        that may be cut between pieces is held back until the next one."""
        text = self._held.pop(index, "") + text
        if not finished:
            for k in range(min(self._longest - 1, len(text)), 0, -1):
                if text[-k:] in self._prefixes:
                    text, self._held[index] = text[:-k], text[-k:]
                    break
        return self.visible(text)

    def copy(self) -> HiddenTokens:
        """A fresh one for another request (nothing held)."""
        return HiddenTokens(self.texts)


# Per tokenizer (a Mistral vocabulary has a thousand special tokens: read them once).
_BY_TOKENIZER: weakref.WeakKeyDictionary[Tokenizer, HiddenTokens | None] = \
    weakref.WeakKeyDictionary()


def hidden_tokens(tokenizer: Tokenizer) -> HiddenTokens | None:
    """The special tokens of ``tokenizer`` (None when it has none), ready for one request."""
    if tokenizer not in _BY_TOKENIZER:
        texts = {tokenizer.decode([i], skip_special_tokens=False)
                 for i in tokenizer.all_special_ids} - {""}
        _BY_TOKENIZER[tokenizer] = HiddenTokens(frozenset(texts)) if texts else None
    found = _BY_TOKENIZER[tokenizer]
    return found.copy() if found is not None else None

