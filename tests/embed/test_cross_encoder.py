"""Cross-encoders (rerankers, BertForSequenceClassification with one label): a pair's two
texts read together with their token types, the [CLS] state through the pooler and the
classifier, its sigmoid the score. A small random checkpoint saved as transformers saves it,
against transformers and sentence-transformers' CrossEncoder on the same folder, through
``LLM.score``, POST /v1/score and /v1/rerank; pairs cut as transformers cuts them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from embed_helpers import save_random_cross_encoder
from server_harness import Server, start_server

from tokenmill import LLM
from tokenmill.engine.pooling import pair_prompt_ids
from tokenmill.models.bert import pair_token_types
from tokenmill.sampling_params import PoolingParams

QUERY = "What is the capital of France?"
DOCS = ["Bees make honey in their hives.", "Paris is the capital of France.", "France",
        "The stock market fell sharply today, " * 3, "paris"]


@pytest.fixture(scope="module")
def hf_tokenizer(minilm_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory, minilm_path: str,
             hf_tokenizer: Any) -> tuple[str, Any]:
    folder = tmp_path_factory.mktemp("cross-encoder")
    model = save_random_cross_encoder(folder, minilm_path)
    # Random weights put every pair far up the sigmoid's flat end: a bias that centres these
    # pairs' logits on 0 spreads their scores out.
    with torch.no_grad():
        logits = model(**hf_tokenizer([QUERY] * len(DOCS), DOCS, padding=True,
                                      return_tensors="pt")).logits
        model.classifier.bias.sub_(logits.mean())
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder), model


@pytest.fixture(scope="module")
def llm(reranker: tuple[str, Any]) -> Iterator[LLM]:
    engine = LLM(reranker[0], task="embed", dtype="float32", max_num_batched_tokens=512)
    yield engine
    engine.close()


def _hf_scores(model: Any, tokenizer: Any, first: list[str], second: list[str],
               **kw: Any) -> np.ndarray:
    enc = tokenizer(first, second, padding=True, return_tensors="pt", **kw)
    with torch.no_grad():
        return torch.sigmoid(model(**enc).logits[:, 0]).numpy()


def test_token_types_start_after_each_sequences_first_separator() -> None:
    sep = 102
    ids = torch.tensor([101, 5, 102, 6, 7, 102, 101, 8, 102, 101, 9, 102, 102, 4])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4])
    got = pair_token_types(ids, positions, sep)
    assert got.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]


def test_scores_are_transformers_and_sentence_transformers(llm: LLM, reranker: tuple[str, Any],
                                                           hf_tokenizer: Any) -> None:
    assert llm.engine.cross_encoder
    got = np.array([o.outputs.score for o in llm.score(QUERY, DOCS)])
    want = _hf_scores(reranker[1], hf_tokenizer, [QUERY] * len(DOCS), DOCS)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.ptp(want) > 0.05  # the pairs score differently: the check can tell them apart
    from sentence_transformers import CrossEncoder

    st = CrossEncoder(reranker[0], device="cpu")
    np.testing.assert_allclose(got, st.predict([(QUERY, d) for d in DOCS]), atol=1e-5)
    # N to N, the pair's token ids as transformers writes them
    outs = llm.score(DOCS[:2], [QUERY, DOCS[2]])
    np.testing.assert_allclose([o.outputs.score for o in outs],
                               _hf_scores(reranker[1], hf_tokenizer, DOCS[:2],
                                          [QUERY, DOCS[2]]), atol=1e-5)
    assert outs[0].prompt_token_ids == hf_tokenizer(DOCS[0], QUERY)["input_ids"]
    # Swapping a pair's texts changes the token types and the score.
    swapped = llm.score(DOCS[1], QUERY)[0].outputs.score
    assert abs(swapped - got[1]) > 1e-4


@pytest.mark.parametrize("limit", [8, 13, 30])
def test_pairs_are_cut_as_transformers_cuts_them(llm: LLM, reranker: tuple[str, Any],
                                                 hf_tokenizer: Any, limit: int) -> None:
    long = DOCS[3] * 4
    first = [QUERY, long, long]
    second = [long, QUERY, "a b c d e f g h"]
    for a, b in zip(first, second, strict=True):
        want = hf_tokenizer(a, b, truncation=True, max_length=limit)["input_ids"]
        assert pair_prompt_ids(llm.get_tokenizer(), a, b,
                               PoolingParams(truncate_prompt_tokens=limit), 128) == want
    got = [o.outputs.score for o in llm.score(first, second, truncate_prompt_tokens=limit)]
    np.testing.assert_allclose(got, _hf_scores(reranker[1], hf_tokenizer, first, second,
                                               truncation=True, max_length=limit), atol=1e-5)


def test_long_pairs_and_embeddings_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"^text_2\[1\]: the pair has .* more than this "
                       "model's maximum of 128"):
        llm.score(QUERY, ["word", "word " * 200])
    with pytest.raises(ValueError, match="leaves no room for the two texts"):
        llm.score(QUERY, "word", truncate_prompt_tokens=3)
    with pytest.raises(ValueError, match="cross-encoder: it scores pairs"):
        llm.embed("hello")


def test_a_pair_scores_the_same_alone_and_in_a_batch(llm: LLM) -> None:
    together = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    alone = [llm.score(QUERY, d)[0].outputs.score for d in DOCS]
    np.testing.assert_allclose(together, alone, atol=1e-6)


def test_other_heads_are_refused(tmp_path: Path, minilm_path: str) -> None:
    save_random_cross_encoder(tmp_path, minilm_path, num_labels=3)
    with pytest.raises(ValueError, match="with 3 labels is not supported"):
        LLM(str(tmp_path), task="embed")


def test_settings_a_cross_encoder_cannot_take_are_refused(reranker: tuple[str, Any]) -> None:
    from tokenmill.model_loader import _sep_token_id
    from tokenmill.models.config import ArchConfig

    with pytest.raises(ValueError, match="pooling 'mean' does not apply to a cross-encoder"):
        LLM(reranker[0], task="embed", pooling="mean")
    config = json.loads((Path(reranker[0]) / "config.json").read_text())
    with pytest.raises(ValueError, match="needs two token types.*got type_vocab_size 1"):
        ArchConfig.from_hf_dict({**config, "type_vocab_size": 1})

    class _NoSep:
        class backend:  # noqa: N801 - stands in for the tokenizers backend
            @staticmethod
            def token_to_id(token: str) -> None:
                return None

    with pytest.raises(ValueError, match="needs a \\[SEP\\] token"):
        _sep_token_id(_NoSep(), "folder")  # type: ignore[arg-type]


# -------------------------------------------------------------------------------- HTTP

@pytest.fixture(scope="module")
def server(reranker: tuple[str, Any]) -> Iterator[Server]:
    s = start_server("--model", reranker[0], "--task", "embed", "--dtype", "float32",
                     "--served-model-name", "reranker", "--max-model-len", "128")
    yield s
    assert s.stop() == 0, s.log()


def test_rerank_and_score_over_http(server: Server, reranker: tuple[str, Any],
                                    hf_tokenizer: Any) -> None:
    want = _hf_scores(reranker[1], hf_tokenizer, [QUERY] * len(DOCS), DOCS)
    r = httpx.post(f"{server.url}/v1/rerank", json={"query": QUERY, "documents": DOCS,
                                                    "top_n": 3}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "reranker"
    assert [x["index"] for x in body["results"]] == list(np.argsort(-want)[:3])
    np.testing.assert_allclose([x["relevance_score"] for x in body["results"]],
                               np.sort(want)[::-1][:3], atol=1e-5)
    pair_tokens = sum(len(hf_tokenizer(QUERY, d)["input_ids"]) for d in DOCS)
    assert body["usage"]["total_tokens"] == pair_tokens
    s = httpx.post(f"{server.url}/v1/score", json={"text_1": QUERY, "text_2": DOCS},
                   timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in s["data"]], want, atol=1e-5)


def test_bad_requests_over_http(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "cross-encoder" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/rerank",
                   json={"query": QUERY, "documents": ["ok", "word " * 200]}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "documents" and error["message"].startswith("documents[1]: ")
    ok = httpx.post(f"{server.url}/v1/rerank", json={"query": QUERY, "documents": ["ok"]},
                    timeout=60)
    assert ok.status_code == 200, ok.text


def test_batch_rerank_lines(llm: LLM) -> None:
    from tokenmill.api.batch_format import parse_line
    from tokenmill.batch.processor import BatchProcessor

    line = {"custom_id": "x", "method": "POST", "url": "/v1/rerank",
            "body": {"query": QUERY, "documents": DOCS, "top_n": 2}}
    [answer] = BatchProcessor(llm.engine, "reranker").run(  # type: ignore[arg-type]
        [parse_line(1, json.dumps(line).encode())])
    response = json.loads(answer.text)["response"]
    assert response["status_code"] == 200
    want = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    assert [x["index"] for x in response["body"]["results"]] == list(np.argsort(want)[::-1][:2])
