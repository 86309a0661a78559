"""The file_search tool: retrieved chunks put in front of the model as numbered sources, and
the answer's citations of them read back as ``file_citation`` annotations.

The search itself belongs to tokenmill/retrieval, a layer above this one: the server hands a
``SearchFn`` in. Its results are numbered [1], [2], ... in rank order and written into the
system part of the prompt with their file names, trimmed so the prompt still leaves room for
the answer. The prompt asks the model to cite the sources it uses as "[n]"; ``CitationReader``
takes those markers out of the answer's text (streamed or whole, the same way) and turns each
into a citation of the source's file at the place it stood. When the model cites nothing, the
answer is annotated with the files that were in its prompt, at the end of the text.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.api.responses_protocol import FileCitation, FileSearchResult
from tokenmill.api.vector_stores import Filter
from tokenmill.tokenizer import Tokenizer


class SearchHit(Protocol):
    """One retrieved chunk (retrieval's SearchResult has this shape)."""

    @property
    def file_id(self) -> str: ...

    @property
    def filename(self) -> str: ...

    @property
    def score(self) -> float: ...

    @property
    def text(self) -> str: ...

    @property
    def attributes(self) -> dict[str, Any] | None: ...


class SearchFn(Protocol):
    """retrieval's ``RetrievalService.search``: the chunks of the given vector stores closest
    to ``query``, best first, of files whose attributes pass ``filters``, scoring at least
    ``score_threshold``. Raises APIError (404 for an unknown vector store)."""

    def __call__(self, vector_store_ids: list[str], query: str, max_num_results: int,
                 filters: Filter | None = None,
                 score_threshold: float = 0.0) -> Awaitable[Sequence[SearchHit]]: ...

SOURCES_HEADER = ("Answer from the sources below. After each statement taken from a source, "
                  "cite it by its number in square brackets, like [1].")
NO_SOURCES = "The search found no sources for this question."
# Fewer tokens than this left for a source's text: the source is left out.
MIN_SOURCE_TOKENS = 16


@dataclass(frozen=True)
class Source:
    """A chunk as it went into the prompt: its number there, and its (maybe trimmed) text."""

    number: int
    file_id: str
    filename: str
    text: str


def result_of(hit: SearchHit) -> FileSearchResult:
    """A hit as a ``file_search_call`` result."""
    attributes = {k: v for k, v in (hit.attributes or {}).items()
                  if isinstance(v, (str, int, float, bool))}
    return FileSearchResult(file_id=hit.file_id, filename=hit.filename, score=float(hit.score),
                            text=hit.text, attributes=attributes or None)


def _entry(number: int, filename: str, text: str) -> str:
    return f"[{number}] {filename}\n{text}"


def sources_block(sources: Sequence[Source]) -> str:
    """The text that goes into the system part of the prompt."""
    if not sources:
        return NO_SOURCES
    entries = "\n\n".join(_entry(s.number, s.filename, s.text) for s in sources)
    return f"{SOURCES_HEADER}\n\n{entries}"


def fit_sources(hits: Sequence[FileSearchResult], tokenizer: Tokenizer,
                budget: int) -> list[Source]:
    """The hits, best first, as sources whose entries take at most ``budget`` tokens in all:
    the text of the last one that fits is cut to the room left, and once less than
    MIN_SOURCE_TOKENS are left the rest are left out."""
    sources: list[Source] = []
    left = budget - len(tokenizer.encode(SOURCES_HEADER, add_special_tokens=False)) - 2
    for hit in hits:
        number = len(sources) + 1
        # The header line, and the blank line that separates entries.
        room = left - len(tokenizer.encode(_entry(number, hit.filename, ""),
                                           add_special_tokens=False)) - 2
        if room < MIN_SOURCE_TOKENS:
            break
        ids = tokenizer.encode(hit.text, add_special_tokens=False)
        text = hit.text if len(ids) <= room else tokenizer.decode(ids[:room])
        sources.append(Source(number, hit.file_id, hit.filename, text))
        left = room - min(len(ids), room)
    return sources


# "[1]", "[1, 2]", "[1][2]", "[Source 1]"; whitespace before a marker goes with it.
_MARKER = re.compile(r"\s*\[(?:sources?\s*)?(\d{1,3}(?:\s*,\s*\d{1,3})*)\]", re.IGNORECASE)
# What may still become a marker: trailing whitespace, then "[" and a few characters.
_MAYBE_MARKER = re.compile(r"\s*(?:\[[^\]\n]{0,24})?\Z")


@dataclass
class CitationReader:
    """Reads the answer's text for source markers: ``feed`` returns the text to pass on (the
    markers of known sources taken out, the end held back while it may still be one) and
    records a citation per marker; ``finish`` lets the rest out."""

    sources: Sequence[Source]
    emitted: int = 0  # characters passed on so far
    citations: list[FileCitation] = field(default_factory=list)
    _pending: str = ""

    def feed(self, text: str) -> str:
        buf = self._pending + text
        out, pos = [], 0
        for m in _MARKER.finditer(buf):
            numbers = [int(n) for n in re.findall(r"\d+", m.group(1))]
            if not numbers or not all(1 <= n <= len(self.sources) for n in numbers):
                continue  # "[2020]" and the like stay text
            out.append(buf[pos:m.start()])
            self._cite(numbers, self.emitted + sum(len(s) for s in out))
            pos = m.end()
        tail = buf[pos:]
        hold = _MAYBE_MARKER.search(tail)
        cut = hold.start() if hold else len(tail)
        out.append(tail[:cut])
        self._pending = tail[cut:]
        passed = "".join(out)
        self.emitted += len(passed)
        return passed

    def finish(self) -> str:
        rest, self._pending = self._pending, ""
        self.emitted += len(rest)
        return rest

    def _cite(self, numbers: list[int], index: int) -> None:
        for n in numbers:
            source = self.sources[n - 1]
            if not any(c.index == index and c.file_id == source.file_id
                       for c in self.citations):
                self.citations.append(FileCitation(index=index, file_id=source.file_id,
                                                   filename=source.filename))

    def annotations(self, text_length: int) -> list[FileCitation]:
        """The citations of the whole answer; without any marker in it, one per file that
        was in the prompt, at the end of the text (the answer was made from them)."""
        if self.citations:
            return list(self.citations)
        seen: dict[str, FileCitation] = {}
        for s in self.sources:
            seen.setdefault(s.file_id, FileCitation(index=text_length, file_id=s.file_id,
                                                    filename=s.filename))
        return list(seen.values())
