"""Special tokens kept in the text for a tool-call format whose markup is special tokens
(Mistral's ``[TOOL_CALLS]`` and ``[ARGS]``, Llama 3's ``<|python_tag|>``), and hidden from
the content the client sees.

With ``skip_special_tokens`` on (every request's default) the detokenizer would drop the
markup, and ``[TOOL_CALLS]get_weather[ARGS]{...}`` would read as the text
``get_weather{...}``. So such a request's output keeps special tokens, the tool reader reads
the calls, and ``HiddenTokens`` takes every special token's text out of what is left, as the
detokenizer would have: the content reads the same as without tools.
"""

from __future__ import annotations

import re
import weakref

from tokenmill.tokenizer import Tokenizer


class HiddenTokens:
    """The text of a vocabulary's special tokens, to take out of content (built once per
    tokenizer: a request's reader keeps what it holds back itself)."""

    def __init__(self, texts: frozenset[str]) -> None:
        self.texts = texts
        self._pattern = re.compile("|".join(map(re.escape, sorted(texts, key=len,
                                                                  reverse=True))))
        self._prefixes = frozenset(t[:k] for t in texts for k in range(1, len(t)))
        self._longest = max(map(len, texts))

    def visible(self, text: str) -> str:
        """``text`` without the special tokens' text."""
        return self._pattern.sub("", text)

    def split_tail(self, text: str) -> tuple[str, str]:
        """``text`` less its end that may begin a special token's text (held back until
        the next piece of a stream shows), and that end."""
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            if text[-k:] in self._prefixes:
                return text[:-k], text[-k:]
        return text, ""


# Per tokenizer (a Mistral vocabulary has a thousand special tokens: read them once).
_BY_TOKENIZER: weakref.WeakKeyDictionary[Tokenizer, HiddenTokens | None] = \
    weakref.WeakKeyDictionary()


def hidden_tokens(tokenizer: Tokenizer) -> HiddenTokens | None:
    """The special tokens of ``tokenizer`` (None when it has none)."""
    if tokenizer not in _BY_TOKENIZER:
        texts = {tokenizer.decode([i], skip_special_tokens=False)
                 for i in tokenizer.all_special_ids} - {""}
        _BY_TOKENIZER[tokenizer] = HiddenTokens(frozenset(texts)) if texts else None
    return _BY_TOKENIZER[tokenizer]

