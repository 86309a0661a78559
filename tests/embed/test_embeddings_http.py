"""POST /v1/embeddings through the official openai client, on a `tokenmill serve --task embed`
of the embedded all-MiniLM-L6-v2: float and base64, dimensions, token-id inputs, usage, and
every bad input a 400 that leaves the next request unaffected."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from embed_helpers import ChatModelFacts
from server_harness import Server, start_server

from tokenmill import LLM
from tokenmill.api.batch_format import parse_line
from tokenmill.api.embeddings import EmbeddingRequest, prepare_embeddings
from tokenmill.api.errors import APIError
from tokenmill.batch.processor import BatchProcessor

TEXTS = ["The cat sat on the mat.", "A completely different sentence about finance.", "hi"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--task", "embed", "--max-num-seqs", "8")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_float_and_base64_agree(client: openai.OpenAI, server: Server) -> None:
    assert server.model == "all-MiniLM-L6-v2"
    floats = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    # The openai client asks for base64 by default and decodes it to floats itself.
    b64 = client.embeddings.create(model=server.model, input=TEXTS)
    assert [d.index for d in floats.data] == [0, 1, 2]
    for f, b in zip(floats.data, b64.data, strict=True):
        assert len(f.embedding) == 384
        np.testing.assert_array_equal(np.float32(f.embedding), np.float32(b.embedding))
        assert abs(np.linalg.norm(f.embedding) - 1.0) < 1e-5
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS) * 2
    assert floats.model == server.model


def test_raw_base64_is_little_endian_float32(server: Server) -> None:
    body = {"input": "hello", "encoding_format": "base64"}
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30).json()
    vector = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype="<f4")
    ref = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello"}, timeout=30).json()
    np.testing.assert_array_equal(vector, np.float32(ref["data"][0]["embedding"]))


def test_dimensions_truncate_and_renormalise(client: openai.OpenAI, server: Server) -> None:
    full = client.embeddings.create(model=server.model, input=TEXTS[0]).data[0].embedding
    short = client.embeddings.create(model=server.model, input=TEXTS[0],
                                     dimensions=48).data[0].embedding
    expected = np.asarray(full[:48]) / np.linalg.norm(full[:48])
    assert len(short) == 48
    np.testing.assert_allclose(short, expected, atol=1e-6)


def test_token_id_inputs(client: openai.OpenAI, server: Server) -> None:
    text = client.embeddings.create(model=server.model, input=TEXTS[0],
                                    encoding_format="float")
    ids = [101, 1996, 4937, 2938, 2006, 1996, 13523, 1012, 102]  # the same sentence
    one = client.embeddings.create(model=server.model, input=ids, encoding_format="float")
    many = client.embeddings.create(model=server.model, input=[ids, ids[:3]],
                                    encoding_format="float")
    assert one.usage.prompt_tokens == text.usage.prompt_tokens == len(ids)
    np.testing.assert_allclose(one.data[0].embedding, text.data[0].embedding, atol=1e-6)
    np.testing.assert_allclose(many.data[0].embedding, text.data[0].embedding, atol=1e-6)
    assert many.usage.prompt_tokens == len(ids) + 3


def test_truncate_prompt_tokens(client: openai.OpenAI, server: Server) -> None:
    r = client.embeddings.create(model=server.model, input="word " * 1000,
                                 extra_body={"truncate_prompt_tokens": 20})
    assert r.usage.prompt_tokens == 20


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": ["ok", 5]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [[1, 2, 10**9]]}, "input"),
    ({"input": "word " * 1000}, "input"),
    ({"input": "x", "dimensions": 385}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ({"input": "x", "model": "no-such-model"}, "model"),
])
def test_bad_input_is_a_400_and_harmless(client: openai.OpenAI, server: Server,
                                         kwargs: dict, param: str) -> None:
    kwargs = {"model": server.model, **kwargs}
    status = 404 if param == "model" else 400
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(**kwargs)
    assert e.value.status_code == status
    assert e.value.body["param"] == param  # type: ignore[index]
    ok = client.embeddings.create(model=server.model, input="next request")
    assert len(ok.data[0].embedding) == 384


@pytest.mark.parametrize("body", [
    {"input": "x", "encoding_format": "int8"},
    {"input": "x", "dimensions": "12"},
    {},
    {"input": {"text": "x"}},
])
def test_malformed_bodies_are_400s(server: Server, body: dict) -> None:
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_chat_to_an_embedding_model_is_a_400(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="computes embeddings"):
        client.chat.completions.create(model=server.model,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="computes embeddings"):
        client.completions.create(model=server.model, prompt="hi")


def test_embeddings_from_a_chat_model_are_a_400() -> None:
    req = EmbeddingRequest(input="hello")
    with pytest.raises(APIError) as e:
        prepare_embeddings(req, ChatModelFacts())  # type: ignore[arg-type]
    assert e.value.status == 400 and "does not serve embeddings" in e.value.message


def test_batch_lines(embed_llm: LLM) -> None:
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": TEXTS, "dimensions": 8}},
        {"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"input": ""}},
        {"custom_id": "c", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": "hi", "encoding_format": "base64"}},
    ]
    requests = [parse_line(i + 1, json.dumps(line).encode()) for i, line in enumerate(lines)]
    answers = {json.loads(a.text)["custom_id"]: json.loads(a.text)
               for a in BatchProcessor(embed_llm.engine, "minilm").run(requests)}  # type: ignore[arg-type]
    a = answers["a"]["response"]
    assert a["status_code"] == 200 and len(a["body"]["data"]) == 3
    assert all(len(d["embedding"]) == 8 for d in a["body"]["data"])
    assert answers["b"]["response"]["status_code"] == 400
    assert isinstance(answers["c"]["response"]["body"]["data"][0]["embedding"], str)
