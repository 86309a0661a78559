"""The server keeps answering while a multi-megabyte file is ingested: /health is polled all
through the ingestion of a 3 MB text file (tokenized by all-MiniLM-L6-v2's tokenizer, the
vectors from the hashing embedder) and every poll is answered, many of them between two
tokenizer calls. No timing is asserted: what is checked is that tokenizing is cut into short
calls and that the event loop answered requests in between them
(benchmarks/retrieval_stalls.py measures the latencies)."""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import tokenizers
import uvicorn
from fastapi import FastAPI

from tokenmill.model_loader import embedded_embedding_model_path
from tokenmill.retrieval import HashEmbedder, RetrievalService
from tokenmill.retrieval.chunking import TOKENIZE_PIECE_CHARS
from tokenmill.retrieval.embedder import TokenizerEmbedder
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.retrieval_routes import retrieval_router

LINE = "The lighthouse keeper logs every passing ship, the gulls and the tide's height.\n"
FILE_CHARS = 3 << 20


class Marks:
    """Counts /health answers; the tokenizer notes the count at each of its calls."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend = backend
        self.health = 0
        self.calls: list[tuple[int, int]] = []  # (characters given, /health answers so far)

    def encode(self, text: str, *args: Any, **kw: Any) -> Any:
        self.calls.append((len(text), self.health))
        return self.backend.encode(text, *args, **kw)

    def encode_batch(self, texts: list[str], *args: Any, **kw: Any) -> Any:
        self.calls.append((sum(map(len, texts)), self.health))
        return self.backend.encode_batch(texts, *args, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path: Any) -> Iterator[tuple[str, Marks]]:
    backend = tokenizers.Tokenizer.from_file(
        os.path.join(embedded_embedding_model_path(), "tokenizer.json"))
    backend.no_truncation()
    backend.no_padding()
    marks = Marks(backend)
    embedder = TokenizerEmbedder(HashEmbedder(dim=64).embed, marks, max_model_len=256)
    service = RetrievalService(str(tmp_path / "data"), embedder)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        await service.start()
        yield
        await service.close()

    app = FastAPI(lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(retrieval_router(service))

    @app.get("/health")
    async def health() -> dict[str, str]:
        marks.health += 1
        return {"status": "ok"}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", marks
    server.should_exit = True
    thread.join(60)


def test_health_is_answered_all_through_a_large_ingestion(served: tuple[str, Marks]) -> None:
    url, marks = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    text = LINE * (FILE_CHARS // len(LINE))
    f = client.files.create(file=("big.txt", io.BytesIO(text.encode())), purpose="assistants")
    store = client.vector_stores.create(name="big", file_ids=[f.id])
    polls = []
    with httpx.Client(timeout=120) as http:  # generous: a stall fails below, not here
        while client.vector_stores.retrieve(store.id).file_counts.in_progress:
            r = http.get(f"{url}/health")
            polls.append(r.status_code)
    assert client.vector_stores.retrieve(store.id).file_counts.completed == 1
    assert polls and set(polls) == {200}
    sizes = [n for n, _ in marks.calls]
    assert sum(sizes) == len(text) and max(sizes) <= TOKENIZE_PIECE_CHARS
    # The event loop answered requests while the file was being tokenized, not only after.
    answered_while_tokenizing = marks.calls[-1][1] - marks.calls[0][1]
    assert answered_while_tokenizing >= 3, marks.calls[:5]
    # The next request is answered as before.
    hit = client.vector_stores.search(store.id, query="lighthouse keeper").data[0]
    assert "lighthouse" in hit.content[0].text
    assert httpx.get(f"{url}/health").status_code == 200
