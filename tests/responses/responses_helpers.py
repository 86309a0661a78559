"""What tests/responses share: a fake retrieval service (a few documents, word-overlap
scores) with retrieval's search signature, and the shape of the in-process server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.api.errors import APIError

DOCS = {
    "file-pelican": ("pelican.md", "The secret code word of the lighthouse is PELICAN. The "
                     "keeper changes the code word every winter."),
    "file-garden": ("garden.txt", "Tomatoes in the community garden are watered every "
                    "Tuesday and Friday morning."),
    "file-bikes": ("bikes.csv", "The bike shop opens at nine and repairs flat tyres for "
                   "twelve euros."),
}


@dataclass(frozen=True)
class FakeHit:
    """retrieval's SearchResult shape."""

    file_id: str
    filename: str
    score: float
    text: str
    attributes: dict[str, Any] | None = None


def _words(text: str) -> set[str]:
    return {w.strip(".,?!").lower() for w in text.split()}


@dataclass
class FakeSearch:
    """Vector store "vs_docs" holds DOCS; scores are the share of the query's words a
    document has. Every call is recorded; ``long`` makes each text 3,000 words long."""

    calls: list[tuple[list[str], str, int, dict[str, Any] | None]] = field(default_factory=list)
    long: bool = False

    async def __call__(self, store_ids: list[str], query: str, max_num_results: int,
                       filters: dict[str, Any] | None) -> list[FakeHit]:
        self.calls.append((store_ids, query, max_num_results, filters))
        for sid in store_ids:
            if sid != "vs_docs":
                raise APIError(404, f"no vector store with id {sid!r}", code="not_found")
        q = _words(query)
        hits = [FakeHit(fid, name, len(q & _words(text)) / max(len(q), 1),
                        " ".join([text] * 150) if self.long else text, {"kind": name[-3:]})
                for fid, (name, text) in DOCS.items()]
        hits.sort(key=lambda h: -h.score)
        return hits[:max_num_results]


@dataclass
class InProcessServer:
    url: str
    model: str
    search: FakeSearch
    max_model_len: int
