"""Scores and reranking on the embedded all-MiniLM-L6-v2: ``LLM.score`` and POST /v1/score,
/v1/rerank (and vLLM's other paths for them), each pair scored by the cosine similarity of
its texts' embeddings, as sentence-transformers scores them; pairing 1 to N and N to N, top_n,
batch lines, and every bad input a 400 naming its field that leaves the next request
unaffected."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from embed_helpers import ChatModelFacts
from server_harness import Server, start_server

from tokenmill import LLM
from tokenmill.api.batch_format import parse_line
from tokenmill.api.errors import APIError
from tokenmill.api.scores import RerankRequest, ScoreRequest, prepare_rerank, prepare_score
from tokenmill.batch.processor import BatchProcessor
from tokenmill.engine.scoring import Pairs, pair_scores, pair_texts

QUERY = "What is the capital of France?"
# Two calls may batch a text with others of other lengths, which rounds its bf16 matmuls
# differently (test_minilm.py::test_mixed_batch_within_bf16_precision): scores from separate
# calls agree to this.
ACROSS = 2e-3
DOCS = ["Bees make honey in their hives.", "Paris is the capital of France.", "France",
        "The stock market fell sharply today."]


def _st_scores(st_model: Any, first: list[str], second: list[str]) -> np.ndarray:
    """sentence-transformers' cosine similarity of each pair (first broadcast if one)."""
    from sentence_transformers import util

    a = st_model.encode(first, convert_to_tensor=True)
    b = st_model.encode(second, convert_to_tensor=True)
    sims = util.cos_sim(a, b)
    if len(first) == 1:
        return sims[0].numpy()
    return sims.diagonal().numpy()


# ----------------------------------------------------------------------- pairing, no model

def test_one_to_many_embeds_the_query_once() -> None:
    pairs = pair_texts(QUERY, DOCS + [QUERY])
    assert pairs.texts == [QUERY, *DOCS]
    assert pairs.names == ["text_1"] + [f"text_2[{i}]" for i in range(4)]
    assert pairs.pairs == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 0)]
    assert pair_texts([QUERY], DOCS[:2]).pairs == [(0, 1), (0, 2)]


def test_many_to_many_pairs_the_ith_of_each() -> None:
    pairs = pair_texts(["a", "b", "a"], ["c", "c", "d"])
    assert pairs.texts == ["a", "b", "c", "d"]
    assert pairs.pairs == [(0, 2), (1, 2), (0, 3)]


@pytest.mark.parametrize("text_1,text_2,message", [
    (["a", "b"], ["c", "d", "e"], r"text_1 must hold one text or as many as text_2 \(3\), got 2"),
    ("a", [], "text_2 must not be empty"),
    ("", "b", "text_1 must not be an empty string"),
    ("a", ["b", ""], r"text_2\[1\] must not be an empty string"),
    ("a", ["b", 7], r"text_2\[1\] must be a string, got int"),
    ({"text": "a"}, "b", "text_1 must be a string or a list of strings, got dict"),
])
def test_bad_pairs_name_the_argument(text_1: Any, text_2: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pair_texts(text_1, text_2)


def test_scores_are_cosines_and_a_zero_vector_scores_zero() -> None:
    pairs = Pairs(["a", "b", "c", "d"], ["a", "b", "c", "d"], [(0, 1), (0, 2), (0, 3), (0, 0)])
    got = pair_scores(pairs, [[3.0, 0.0], [1.0, 1.0], [0.0, 0.0], [-2.0, 0.0]])
    np.testing.assert_allclose(got, [2 ** -0.5, 0.0, -1.0, 1.0], atol=1e-12)
    with pytest.raises(ValueError, match="3 embeddings for 4 texts"):
        pair_scores(pairs, [[1.0]] * 3)


# --------------------------------------------------------------------------- LLM.score

def test_llm_score_is_sentence_transformers_cosine(embed_llm: LLM, st_model: Any) -> None:
    outs = embed_llm.score(QUERY, DOCS)
    want = _st_scores(st_model, [QUERY], DOCS)
    got = np.array([o.outputs.score for o in outs])
    np.testing.assert_allclose(got, want, atol=3e-3)
    assert int(np.argmax(got)) == 1  # Paris
    query_ids = embed_llm.embed(QUERY)[0].prompt_token_ids
    for out, doc in zip(outs, DOCS, strict=True):
        doc_ids = embed_llm.embed(doc)[0].prompt_token_ids
        assert out.prompt_token_ids == query_ids + doc_ids
        assert out.finished

    pairs = embed_llm.score(DOCS[:2], [DOCS[0], QUERY])
    np.testing.assert_allclose([o.outputs.score for o in pairs],
                               _st_scores(st_model, DOCS[:2], [DOCS[0], QUERY]), atol=3e-3)
    assert pairs[0].outputs.score == pytest.approx(1.0, abs=1e-6)  # a text against itself


def test_llm_score_refuses_bad_arguments_and_chat_engines(embed_llm: LLM) -> None:
    with pytest.raises(ValueError, match="text_1 must hold one text or as many"):
        embed_llm.score(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="more than this model's maximum"):
        embed_llm.score("a", "word " * 1000)
    long = embed_llm.score("a", "word " * 1000, truncate_prompt_tokens=16)
    assert len(long[0].prompt_token_ids) == len(embed_llm.embed("a")[0].prompt_token_ids) + 16
    chat = LLM(max_model_len=256, num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match="score needs an embedding model"):
            chat.score("a", "b")
    finally:
        chat.close()


# -------------------------------------------------------------------------------- HTTP

@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--task", "embed", "--max-num-seqs", "8")
    yield s
    assert s.stop() == 0, s.log()


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_is_the_cosine_of_the_embeddings_endpoints_vectors(server: Server,
                                                                 path: str) -> None:
    r = _post(server, path, {"model": server.model, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == server.model
    assert body["id"].startswith("score-") and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "score" for d in body["data"])
    vectors = _post(server, "/v1/embeddings", {"input": [QUERY, *DOCS]}).json()
    e = np.array([d["embedding"] for d in vectors["data"]])
    want = e[1:] @ e[0] / (np.linalg.norm(e[1:], axis=1) * np.linalg.norm(e[0]))
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=ACROSS)
    # Each text counted once: the query is not embedded again for each document.
    assert body["usage"]["prompt_tokens"] == vectors["usage"]["prompt_tokens"]
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]


def test_score_many_to_many(server: Server, embed_llm: LLM) -> None:
    text_1, text_2 = [QUERY, DOCS[0]], [DOCS[1], DOCS[0]]
    body = _post(server, "/v1/score", {"text_1": text_1, "text_2": text_2}).json()
    want = [o.outputs.score for o in embed_llm.score(text_1, text_2)]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=ACROSS)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents(server: Server, path: str) -> None:
    r = _post(server, path, {"model": server.model, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    scores = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS}).json()["data"]
    by_score = sorted(range(len(DOCS)), key=lambda i: -scores[i]["score"])
    assert [x["index"] for x in body["results"]] == by_score
    relevance = [x["relevance_score"] for x in body["results"]]
    assert relevance == sorted(relevance, reverse=True)
    assert body["results"][0]["index"] == 1  # Paris
    for x in body["results"]:
        assert x["document"] == {"text": DOCS[x["index"]]}
        assert x["relevance_score"] == pytest.approx(scores[x["index"]]["score"], abs=ACROSS)
    assert body["id"].startswith("rerank-") and body["model"] == server.model
    assert body["usage"]["total_tokens"] > len(DOCS)


def test_rerank_top_n_and_without_documents(server: Server) -> None:
    full = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()["results"]
    top = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2,
                                       "return_documents": False}).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full[:2]]
    assert all(x["document"] is None for x in top)
    many = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 99})
    assert len(many.json()["results"]) == len(DOCS)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2"),
    ("/v1/score", {"text_1": 3, "text_2": "b"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": "word " * 1000}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("/v1/score", {"text_1": "a", "text_2": ["b"] * 2049}, "text_2"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/rerank", {"query": ["a"], "documents": ["b"]}, "query"),
    ("/v1/rerank", {"query": "", "documents": ["b"]}, "query"),
    ("/v1/rerank", {"query": "a", "documents": "b"}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b", {"text": "c"}]}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": "2"}, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "model": "no-such-model"}, "model"),
])
def test_bad_input_is_a_400_naming_the_field_and_harmless(server: Server, path: str,
                                                           body: dict, param: str) -> None:
    r = _post(server, path, body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["type"] == ("not_found_error" if param == "model" else "invalid_request_error")
    assert error["param"] == param, error
    ok = _post(server, path, {"text_1": "a", "text_2": "b"} if path == "/v1/score"
               else {"query": "a", "documents": ["b"]})
    assert ok.status_code == 200, ok.text


def test_long_texts_are_cut_with_truncate_prompt_tokens(server: Server) -> None:
    body = {"text_1": "a", "text_2": "word " * 1000, "truncate_prompt_tokens": 16}
    r = _post(server, "/v1/score", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3 + 16  # [CLS] a [SEP], then 16


def test_scores_from_a_chat_model_are_a_400() -> None:
    for prepare, req in ((prepare_score, ScoreRequest(text_1="a", text_2="b")),
                         (prepare_rerank, RerankRequest(query="a", documents=["b"]))):
        with pytest.raises(APIError) as e:
            prepare(req, ChatModelFacts())  # type: ignore[operator]
        assert e.value.status == 400 and "does not serve embeddings" in e.value.message


# ------------------------------------------------------------------------------ batch

def test_batch_lines(embed_llm: LLM) -> None:
    lines = [
        {"custom_id": "s", "method": "POST", "url": "/v1/score",
         "body": {"text_1": QUERY, "text_2": DOCS}},
        {"custom_id": "r", "method": "POST", "url": "/v1/rerank",
         "body": {"query": QUERY, "documents": DOCS, "top_n": 1}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/rerank",
         "body": {"query": QUERY, "documents": []}},
    ]
    requests = [parse_line(i + 1, json.dumps(line).encode()) for i, line in enumerate(lines)]
    answers = {json.loads(a.text)["custom_id"]: json.loads(a.text)["response"]
               for a in BatchProcessor(embed_llm.engine, "minilm").run(requests)}  # type: ignore[arg-type]
    want = [o.outputs.score for o in embed_llm.score(QUERY, DOCS)]
    s = answers["s"]
    assert s["status_code"] == 200
    np.testing.assert_allclose([d["score"] for d in s["body"]["data"]], want, atol=ACROSS)
    r = answers["r"]
    assert r["status_code"] == 200
    assert [x["index"] for x in r["body"]["results"]] == [int(np.argmax(want))]
    assert answers["bad"]["status_code"] == 400
    assert answers["bad"]["body"]["error"]["param"] == "documents"
