"""`tokenmill bench retrieval`'s measuring loop on its real corpus, with the hashing embedder
(the benchmark itself uses MiniLM): the exact index must match brute force."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from tokenmill.bench.retrieval import CORPUS, run_once
from tokenmill.retrieval import HashEmbedder
from tokenmill.retrieval.index import normalise


def test_corpus_questions_point_at_their_passages() -> None:
    corpus = json.loads(CORPUS.read_text(encoding="utf-8"))
    docs = {d["id"]: d["text"] for d in corpus["documents"]}
    assert len(corpus["questions"]) >= 50
    for q in corpus["questions"]:
        assert q["answer"] in docs[q["document"]], q


def test_index_matches_brute_force_with_distractors() -> None:
    corpus = json.loads(CORPUS.read_text(encoding="utf-8"))
    embedder = HashEmbedder(dim=128, max_input_tokens=254)
    qs = [q["question"] for q in corpus["questions"]]
    qvecs = normalise(np.array(asyncio.run(embedder.embed(qs)), dtype=np.float32))
    r = asyncio.run(run_once(embedder, corpus, 500, qvecs, None))
    assert r["chunks"] == r["corpus_chunks"] + 500
    for level in ("doc", "passage"):
        for k in (1, 5):
            assert r[f"index_{level}_recall@{k}"] == r[f"brute_{level}_recall@{k}"]
    assert r["brute_doc_recall@5"] > 0.5  # bag of words finds most articles
