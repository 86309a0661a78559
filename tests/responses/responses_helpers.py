"""What tests/responses share: a fake retrieval service (a few documents, word-overlap
scores) with retrieval's search signature, and the shape of the in-process server."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenmill.api.errors import APIError

T = TypeVar("T")

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
    document has. Every call is recorded (filters as JSON); ``long`` makes each text 3,000
    words long. Other store ids go to ``real`` (the real retrieval service), if set."""

    calls: list[tuple[list[str], str, int, Any]] = field(default_factory=list)
    long: bool = False
    real: Any = None

    async def __call__(self, store_ids: list[str], query: str, max_num_results: int,
                       filters: Any = None, score_threshold: float = 0.0) -> list[Any]:
        if self.real is not None and "vs_docs" not in store_ids:
            return await self.real(store_ids, query, max_num_results, filters, score_threshold)
        self.calls.append((store_ids, query, max_num_results,
                           None if filters is None else filters.model_dump()))
        for sid in store_ids:
            if sid != "vs_docs":
                raise APIError(404, f"No vector store found with id '{sid}'.",
                               param="vector_store_ids", code="not_found")
        q = _words(query)
        hits = [FakeHit(fid, name, len(q & _words(text)) / max(len(q), 1),
                        " ".join([text] * 150) if self.long else text, {"kind": name[-3:]})
                for fid, (name, text) in DOCS.items()]
        hits = [h for h in hits if h.score >= score_threshold]
        hits.sort(key=lambda h: -h.score)
        return hits[:max_num_results]


@dataclass
class InProcessServer:
    """The in-process server: its address, model name, search, context length, and the
    event loop it runs on (``run`` awaits a coroutine there, e.g. the retrieval service's)."""

    url: str
    model: str
    search: FakeSearch
    max_model_len: int
    loop: asyncio.AbstractEventLoop
    retrieval: Any

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)
