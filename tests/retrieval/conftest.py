"""Fixtures of tests/retrieval: a data folder, a test server on it, an openai client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from retrieval_harness import RetrievalServer


@pytest.fixture
def data_dir(tmp_path: Any) -> str:
    return str(tmp_path / "data")


@pytest.fixture
def server(data_dir: str) -> Iterator[RetrievalServer]:
    s = RetrievalServer(data_dir).start()
    yield s
    s.stop()


@pytest.fixture
def client(server: RetrievalServer) -> openai.OpenAI:
    return server.client()
