"""tests/responses: the Responses API through the official client, against `tokenmill serve`
(the app as shipped) and against an in-process server whose file_search runs on a fake
retrieval service (a few documents, word-overlap scores)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import openai
import pytest
import uvicorn
from fastapi import FastAPI

# The server test harness lives in tests/server; import it rather than copy it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "server"))

from responses_helpers import FakeSearch, InProcessServer  # noqa: E402
from server_harness import BASE_ARGS, Server, free_port, start_server  # noqa: E402


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`tokenmill serve` as shipped: the embedded chat and embedding models, vector stores in
    a temporary folder."""
    s = start_server("--max-num-seqs", "8", "--data-dir",
                     str(tmp_path_factory.mktemp("serve-data")))
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="session")
def rag(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """The responses routes on the embedded model with ``FakeSearch`` as the search; stores
    other than its "vs_docs" are the real retrieval service's (a data folder of its own, the
    deterministic HashEmbedder), whose files and vector stores routes are served too."""
    from tokenmill.cli import build_parser
    from tokenmill.config import ServerConfig
    from tokenmill.model_loader.gguf import embedded_model_path
    from tokenmill.retrieval.embedder import HashEmbedder
    from tokenmill.retrieval.service import RetrievalService
    from tokenmill.server.errors import install_error_handlers
    from tokenmill.server.launcher import load_models
    from tokenmill.server.model_registry import served_models
    from tokenmill.server.responses_routes import responses_router
    from tokenmill.server.retrieval_routes import retrieval_router

    # The chat model alone (the real retrieval service below embeds with the HashEmbedder).
    args = build_parser().parse_args(["serve", *BASE_ARGS,
                                      "--model", f"rag={embedded_model_path()}"])
    state = load_models(served_models(args), ServerConfig())
    max_model_len = state.model(None).client.max_model_len
    retrieval = RetrievalService(str(tmp_path_factory.mktemp("retrieval")), HashEmbedder())
    search = FakeSearch(real=retrieval.search)
    loops: list[asyncio.AbstractEventLoop] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loops.append(asyncio.get_running_loop())
        for client in state.clients:
            client.start()
        yield
        for client in state.clients:
            await client.shutdown()
        await retrieval.close()

    app = FastAPI(lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(responses_router(state, search))
    app.include_router(retrieval_router(retrieval))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started, "the in-process server did not start"
    yield InProcessServer(f"http://127.0.0.1:{port}", "rag", search, max_model_len,
                          loops[0], retrieval)
    uv.should_exit = True
    thread.join(30)
    state.workers.shutdown(wait=False)


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def rag_client(rag: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{rag.url}/v1", api_key="unused", max_retries=0)
