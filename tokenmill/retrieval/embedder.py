"""What retrieval needs from an embedding model, and two ways to have it: an adapter over any
async ``embed`` function plus a Hugging Face tokenizer, and a deterministic hashing embedder for
tests and for running without a model."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from tokenmill.api.chat import MAX_CHARS_PER_TOKEN


@runtime_checkable
class Embedder(Protocol):
    """An embedding model as retrieval sees it.

    ``max_input_tokens``: the most tokens one text may have (as ``token_spans`` counts them,
    i.e. without the special tokens the model adds), so a chunk is never cut by the model.
    ``token_spans``: the character span ``(start, end)`` of each token of ``text``; chunks
    are cut on token boundaries but keep the original text (a WordPiece ``decode`` would lower-
    case it and lose its spacing). Chunking calls it on pieces of a file of at most
    ``chunking.TOKENIZE_PIECE_CHARS`` characters, so that no call runs long.
    ``embed``: one vector per text, all of the same length.
    """

    max_input_tokens: int

    def token_spans(self, text: str) -> list[tuple[int, int]]: ...

    async def embed(self, texts: list[str]) -> list[list[float]]: ...


class TokenizerEmbedder:
    """An Embedder from an async ``embed`` function and a ``tokenizers.Tokenizer`` (or a
    transformers fast tokenizer): the lead wires the engine's ``AsyncLLM.embed`` in this way.

    ``special_tokens``: the tokens the model adds to every input ([CLS] and [SEP] for BERT),
    subtracted from ``max_model_len`` to give ``max_input_tokens``.
    """

    def __init__(self, embed: Callable[[list[str]], Awaitable[list[list[float]]]],
                 tokenizer: Any, max_model_len: int, special_tokens: int = 2) -> None:
        if max_model_len <= special_tokens:
            raise ValueError(f"max_model_len must exceed {special_tokens}, got {max_model_len}")
        self._embed = embed
        self._tokenizer = tokenizer
        self.max_input_tokens = max_model_len - special_tokens

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the tokens of ``text``, special tokens left out."""
        tok = self._tokenizer
        # A batch of one: the tokenizers library releases the GIL while it encodes a batch,
        # not while it encodes a single text.
        if hasattr(tok, "encode_batch"):  # tokenizers.Tokenizer
            return [tuple(o) for o in tok.encode_batch([text], add_special_tokens=False)[0]
                    .offsets]
        enc = tok([text], add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [tuple(o) for o in enc["offset_mapping"][0]]

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """The model's vectors for ``texts``, each cut to what the model can read (see
        ``readable``)."""
        return await self._embed([readable(t, self.max_input_tokens) for t in texts])


def max_text_chars(max_input_tokens: int) -> int:
    """The most characters of one text that are ever tokenized for a model reading
    ``max_input_tokens`` tokens (the chat routes' bound, MAX_CHARS_PER_TOKEN a token)."""
    return max_input_tokens * MAX_CHARS_PER_TOKEN


def readable(text: str, max_input_tokens: int) -> str:
    """``text`` cut to ``max_text_chars``: the model reads only its first tokens, which lie
    in that prefix unless they average more than MAX_CHARS_PER_TOKEN characters, and the
    engine's tokenizer would hold the GIL for seconds on a few megabytes."""
    limit = max_text_chars(max_input_tokens)
    return text if len(text) <= limit else text[:limit]


_WORD = re.compile(r"\w+|[^\w\s]")


class HashEmbedder:
    """A deterministic bag-of-words embedder: each word adds +-1 to a hashed dimension, and the
    vector is normalised. Texts sharing words are close, so search behaves sensibly in tests;
    no model and no randomness are involved. Tokens are words and punctuation marks."""

    def __init__(self, dim: int = 64, max_input_tokens: int = 512) -> None:
        self.dim = dim
        self.max_input_tokens = max_input_tokens
        self.calls = 0  # embed calls so far, for tests

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """Spans of the words and punctuation marks of ``text``."""
        return [m.span() for m in _WORD.finditer(text)]

    def vector(self, text: str) -> list[float]:
        """The vector of one text (all zeros but one for a text without words)."""
        v = [0.0] * self.dim
        for word in _WORD.findall(text.lower()):
            h = hashlib.blake2b(word.encode(), digest_size=8).digest()
            v[int.from_bytes(h[:4], "little") % self.dim] += 1.0 if h[4] & 1 else -1.0
        norm = math.sqrt(sum(x * x for x in v))
        if norm == 0.0:
            v[0], norm = 1.0, 1.0
        return [x / norm for x in v]

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """The vectors of ``texts``."""
        self.calls += 1
        return [self.vector(t) for t in texts]
