"""Splitting text into chunks of at most N tokens of the embedding model, overlapping by M, as
OpenAI's ``static`` chunking strategy does; ``auto`` is static with OpenAI's 800 / 400, shrunk
to what the embedding model can read at once.

A long text is tokenized in pieces of at most TOKENIZE_PIECE_CHARS characters, cut at
whitespace: one tokenizer call on a whole file holds the GIL (and so stalls the event loop and
every other thread) for about a second per megabyte, a piece for a few milliseconds. Tokens
stream into windows as they come, so a file's tokens are never all held at once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tokenmill.api.errors import bad_request
from tokenmill.api.vector_stores import (
    AUTO_CHUNK_TOKENS,
    AUTO_OVERLAP_TOKENS,
    ChunkingParam,
    StaticChunking,
    StaticChunkingParam,
)

# Characters given to the tokenizer in one call: a few milliseconds of work.
TOKENIZE_PIECE_CHARS = 1 << 15
# How far back from a piece's end a cut looks for whitespace, so that no word is split.
CUT_SEARCH_CHARS = 1 << 10


@dataclass(frozen=True)
class Chunking:
    """Chunks of at most ``max_tokens`` tokens, each starting ``max_tokens - overlap`` tokens
    after the previous one."""

    max_tokens: int
    overlap: int

    def as_static(self) -> StaticChunking:
        """The strategy as the API reports it."""
        return StaticChunking(max_chunk_size_tokens=self.max_tokens,
                              chunk_overlap_tokens=self.overlap)


def resolve_chunking(param: ChunkingParam | None, max_input_tokens: int) -> Chunking:
    """The chunking a request asks for. ``auto`` (or none) gives OpenAI's 800 / 400, or the
    model's limit and half of it when the model reads fewer than 800 tokens. A static size
    over the model's limit is a 400: the model would never see the end of each chunk, so
    that text could never be found."""
    if isinstance(param, StaticChunkingParam):
        s = param.static
        if s.max_chunk_size_tokens > max_input_tokens:
            raise bad_request(
                f"chunking_strategy.static.max_chunk_size_tokens ({s.max_chunk_size_tokens}) "
                f"exceeds the {max_input_tokens} tokens the embedding model reads at once",
                "chunking_strategy")
        return Chunking(s.max_chunk_size_tokens, s.chunk_overlap_tokens)
    size = min(AUTO_CHUNK_TOKENS, max_input_tokens)
    return Chunking(size, min(AUTO_OVERLAP_TOKENS, size // 2))


@dataclass(frozen=True)
class Chunk:
    """A piece of a document: its text and where it starts in the document."""

    text: str
    start: int


def text_pieces(text: str, size: int = TOKENIZE_PIECE_CHARS) -> Iterator[tuple[int, str]]:
    """``text`` as consecutive pieces of at most ``size`` characters, each with its offset.
    A cut falls just before a whitespace character (the last one in the piece's final
    CUT_SEARCH_CHARS), so no word, and so no token, is split; a longer word is cut where the
    piece ends."""
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    start, n = 0, len(text)
    while start < n:
        end = min(start + size, n)
        if end < n:
            end = _last_space(text, max(start + 1, end - CUT_SEARCH_CHARS), end) or end
        yield start, text[start:end]
        start = end


def _last_space(text: str, lo: int, hi: int) -> int | None:
    """The last index in [lo, hi] holding whitespace, or None."""
    for i in range(hi, lo - 1, -1):
        if text[i].isspace():
            return i
    return None


def chunk_text(text: str, spans: Callable[[str], list[tuple[int, int]]],
               chunking: Chunking, piece_chars: int = TOKENIZE_PIECE_CHARS) -> list[Chunk]:
    """``text`` cut into windows of ``chunking.max_tokens`` tokens that overlap by
    ``chunking.overlap`` tokens; each chunk is the original text from its first token's
    start to its last token's end. ``spans`` gives the token spans of one piece of at most
    ``piece_chars`` characters (see text_pieces)."""
    step = chunking.max_tokens - chunking.overlap
    size = chunking.max_tokens
    # The tokens from the next chunk's first one on, at their offsets in ``text``.
    tokens: list[tuple[int, int]] = []
    chunks: list[Chunk] = []
    for offset, piece in text_pieces(text, piece_chars):
        tokens.extend((s + offset, e + offset) for s, e in spans(piece))
        first = 0
        # A window that does not reach the last token known so far is followed by another.
        while len(tokens) - first > size:
            chunks.append(_chunk(text, tokens[first], tokens[first + size - 1]))
            first += step
        del tokens[:first]
    if tokens:
        chunks.append(_chunk(text, tokens[0], tokens[-1]))
    return chunks


def _chunk(text: str, first: tuple[int, int], last: tuple[int, int]) -> Chunk:
    return Chunk(text[first[0]:last[1]], first[0])
