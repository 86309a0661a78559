"""Chunking, text extraction, attribute filters and the embedders, without a server."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tokenmill.api.errors import APIError
from tokenmill.api.vector_stores import SearchRequest, StaticChunkingParam
from tokenmill.retrieval import HashEmbedder, TokenizerEmbedder
from tokenmill.retrieval.chunking import Chunking, chunk_text, resolve_chunking
from tokenmill.retrieval.extract import InvalidFile, UnsupportedFile, extract_text, html_text
from tokenmill.retrieval.filters import matches
from tokenmill.retrieval.index import StoreIndex, normalise


def spans(text: str) -> list[tuple[int, int]]:
    return HashEmbedder().token_spans(text)


def test_chunks_are_windows_of_the_original_text() -> None:
    words = [f"Word{i}," for i in range(250)]
    text = "  ".join(words)  # double spaces and capitals must survive
    chunks = chunk_text(text, spans, Chunking(100, 40))
    # 500 tokens (word + comma), windows of 100 starting every 60 tokens.
    assert len(chunks) == 8
    for c in chunks:
        assert text[c.start:c.start + len(c.text)] == c.text
        assert len(spans(c.text)) <= 100
    assert chunks[0].text.startswith("Word0,  Word1,") and chunks[-1].text.endswith("Word249,")
    # Consecutive chunks share exactly the overlap.
    first_tail = chunks[0].text[chunks[1].start - chunks[0].start:]
    assert chunks[1].text.startswith(first_tail) and len(spans(first_tail)) == 40


def test_short_and_empty_texts() -> None:
    assert [c.text for c in chunk_text("just a few words", spans, Chunking(100, 50))] == [
        "just a few words"]
    assert chunk_text("   ", spans, Chunking(100, 50)) == []


def test_chunking_resolution() -> None:
    assert resolve_chunking(None, 4096) == Chunking(800, 400)
    assert resolve_chunking(None, 254) == Chunking(254, 127)  # MiniLM reads 256 - 2
    static = StaticChunkingParam.model_validate(
        {"type": "static", "static": {"max_chunk_size_tokens": 200, "chunk_overlap_tokens": 20}})
    assert resolve_chunking(static, 254) == Chunking(200, 20)
    with pytest.raises(APIError) as e:
        resolve_chunking(static, 150)
    assert e.value.status == 400 and e.value.param == "chunking_strategy"


def test_extraction() -> None:
    assert extract_text("\ufeffhello".encode(), "a.txt") == "hello"  # BOM dropped
    assert extract_text(b"def f(): pass", "lib.py") == "def f(): pass"
    assert extract_text(b"all: build", "Makefile") == "all: build"
    html = ("<html><head><title>T</title><script>var x = '<p>';</script></head><body>"
            "<p>One &amp; two</p><div>three<br>four</div></body></html>")
    assert html_text(html) == "One & two\nthree\nfour"
    for name, data, error in [("a.pdf", b"%PDF", UnsupportedFile), ("noext", b"x", UnsupportedFile),
                              ("a.txt", b"", InvalidFile), ("a.txt", b"a\x00b", InvalidFile),
                              ("a.txt", b"\xc3\x28", InvalidFile),
                              ("a.html", b"<script>only()</script>", InvalidFile)]:
        with pytest.raises(error):
            extract_text(data, name)


def _filter(f: dict):  # noqa: ANN202 - a pydantic Filter
    return SearchRequest.model_validate({"query": "q", "filters": f}).filters


@pytest.mark.parametrize("f,attrs,expected", [
    ({"key": "n", "type": "eq", "value": 3}, {"n": 3}, True),
    ({"key": "n", "type": "eq", "value": 3}, {"n": 3.0}, True),
    ({"key": "n", "type": "eq", "value": 1}, {"n": True}, False),  # booleans are not numbers
    ({"key": "n", "type": "eq", "value": "3"}, {"n": 3}, False),
    ({"key": "n", "type": "ne", "value": 3}, {"n": 4}, True),
    ({"key": "n", "type": "ne", "value": 3}, {}, False),  # a missing key matches nothing
    ({"key": "n", "type": "gt", "value": 3}, {"n": 3}, False),
    ({"key": "n", "type": "gte", "value": 3}, {"n": 3}, True),
    ({"key": "n", "type": "lt", "value": 3}, {"n": "2"}, False),
    ({"key": "d", "type": "lte", "value": "2024-06"}, {"d": "2024-01"}, True),
    ({"key": "s", "type": "in", "value": ["a", "b"]}, {"s": "b"}, True),
    ({"key": "s", "type": "nin", "value": ["a", "b"]}, {"s": "c"}, True),
    ({"key": "b", "type": "eq", "value": False}, {"b": False}, True),
    ({"type": "and", "filters": [{"key": "a", "type": "eq", "value": 1},
                                 {"type": "or", "filters": [
                                     {"key": "b", "type": "eq", "value": 2},
                                     {"key": "c", "type": "eq", "value": 3}]}]},
     {"a": 1, "c": 3}, True),
    ({"type": "and", "filters": [{"key": "a", "type": "eq", "value": 1},
                                 {"key": "b", "type": "eq", "value": 2}]}, {"a": 1}, False),
])
def test_filters(f: dict, attrs: dict, expected: bool) -> None:
    assert matches(_filter(f), attrs) is expected


def test_hash_embedder_is_deterministic_and_normalised() -> None:
    e = HashEmbedder(dim=32)
    a, b = asyncio.run(e.embed(["the cat sat", "The cat sat"]))
    assert a == b and abs(np.linalg.norm(a) - 1) < 1e-9
    assert e.token_spans("Hi, you!") == [(0, 2), (2, 3), (4, 7), (7, 8)]


def test_tokenizer_embedder_with_a_tokenizers_tokenizer() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()

    async def embed(texts: list[str]) -> list[list[float]]:
        return [[1.0, 0.0] for _ in texts]

    e = TokenizerEmbedder(embed, tok, max_model_len=256)
    assert e.max_input_tokens == 254
    assert e.token_spans("hello  World") == [(0, 5), (7, 12)]
    assert asyncio.run(e.embed(["x"])) == [[1.0, 0.0]]


def test_index_filters_and_removal() -> None:
    rng = np.random.default_rng(0)
    x = normalise(rng.standard_normal((30, 8)))
    idx = StoreIndex(8)
    idx.add("a", np.arange(0, 10), x[:10])
    idx.add("b", np.arange(10, 30), x[10:])
    q = x[12:13]
    assert idx.search(q, 1, None)[0][0] == 12
    assert all(cid < 10 for cid, _ in idx.search(q, 5, {"a"}))
    assert idx.search(q, 5, set()) == []
    idx.remove_file("b")
    assert idx.index.ntotal == 10 and all(cid < 10 for cid, _ in idx.search(q, 5, None))
    brute = np.argsort(-(x[:10] @ q[0]))[:5].tolist()
    assert [cid for cid, _ in idx.search(q, 5, None)] == brute


def test_faiss_is_imported_on_first_use_with_one_thread_there() -> None:
    """The server starts without FAISS (its import is ~0.16 s of a start): a new service and
    its start() leave it unimported; the first index built on the service's thread imports it,
    and runs it there on one OpenMP thread."""
    import subprocess
    import sys

    script = """
import asyncio, sys, tempfile
from tokenmill.retrieval import HashEmbedder, RetrievalService
import tokenmill.server.app
svc = RetrievalService(tempfile.mkdtemp(), HashEmbedder())
asyncio.run(svc.start())
assert "faiss" not in sys.modules, "faiss imported at start"
from tokenmill.retrieval.index import StoreIndex
def build():
    StoreIndex(8)
    return sys.modules["faiss"].omp_get_max_threads()
print("threads", asyncio.run(svc._on_thread(build)))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "threads 1" in out.stdout
