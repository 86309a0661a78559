"""Shared fixtures of the embedding tests: the embedded all-MiniLM-L6-v2 folder, an engine on
it, sentence-transformers on the same folder."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenmill import LLM
from tokenmill.model_loader import embedded_embedding_model_path

# The server tests' harness (start_server) is shared, not copied.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))


@pytest.fixture(scope="session")
def minilm_path() -> str:
    return embedded_embedding_model_path()


@pytest.fixture(scope="session")
def embed_llm(minilm_path: str) -> Iterator[LLM]:
    llm = LLM(minilm_path, task="embed", max_num_seqs=32, max_num_batched_tokens=1024)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def st_model(minilm_path: str) -> Any:
    """sentence-transformers' own model on the same folder."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu")
