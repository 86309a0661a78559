"""Splitting text into chunks of at most N tokens of the embedding model, overlapping by M, as
OpenAI's ``static`` chunking strategy does; ``auto`` is static with OpenAI's 800 / 400, shrunk
to what the embedding model can read at once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.api.errors import bad_request
from tokenmill.api.vector_stores import (
    AUTO_CHUNK_TOKENS,
    AUTO_OVERLAP_TOKENS,
    ChunkingParam,
    StaticChunking,
    StaticChunkingParam,
)


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


def chunk_text(text: str, spans: Callable[[str], list[tuple[int, int]]],
               chunking: Chunking) -> list[Chunk]:
    """``text`` cut into windows of ``chunking.max_tokens`` tokens (token spans from
    ``spans``) that overlap by ``chunking.overlap`` tokens; each chunk is the original text
    from its first token's start to its last token's end."""
    tokens = spans(text)
    if not tokens:
        return []
    step = chunking.max_tokens - chunking.overlap
    chunks: list[Chunk] = []
    for first in range(0, len(tokens), step):
        last = min(first + chunking.max_tokens, len(tokens)) - 1
        start, end = tokens[first][0], tokens[last][1]
        chunks.append(Chunk(text[start:end], start))
        if last == len(tokens) - 1:
            break
    return chunks
