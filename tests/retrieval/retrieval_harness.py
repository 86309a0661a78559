"""A test server of the Files and Vector Stores routes on a free loopback port, over a
RetrievalService with the deterministic hashing embedder (no model needed)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

import openai
import uvicorn
from fastapi import FastAPI

from tokenmill.retrieval import Embedder, HashEmbedder, RetrievalService
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.retrieval_routes import RetrievalLimits, retrieval_router


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RetrievalServer:
    """uvicorn on a thread, serving ``retrieval_router`` for one data folder."""

    def __init__(self, data_dir: str, embedder: Embedder | None = None,
                 limits: RetrievalLimits | None = None) -> None:
        self.embedder = embedder or HashEmbedder(dim=256, max_input_tokens=400)
        self.service = RetrievalService(data_dir, self.embedder)
        service = self.service

        @asynccontextmanager
        async def lifespan(_: FastAPI) -> Any:
            await service.start()
            yield
            await service.close()

        app = FastAPI(lifespan=lifespan)
        install_error_handlers(app)
        app.include_router(retrieval_router(service, limits))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> RetrievalServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the retrieval test server did not start")
            time.sleep(0.02)
        return self

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kw)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        assert not self._thread.is_alive(), "the retrieval test server did not stop"


def wait_done(client: openai.OpenAI, store_id: str, timeout: float = 30) -> None:
    """Wait until no file of the store is in progress."""
    deadline = time.monotonic() + timeout
    while client.vector_stores.retrieve(store_id).file_counts.in_progress:
        assert time.monotonic() < deadline, "ingestion did not finish"
        time.sleep(0.02)
