"""Ollama's API through the official `ollama` Python client against a real server: list,
show, ps, version, chat and generate (streamed and whole, options, JSON format), embeddings,
and Ollama-style errors."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import Server

ollama = pytest.importorskip("ollama")

CHAT = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def client(server: Server):
    return ollama.Client(host=server.url)


def test_list_show_ps_version(client, server: Server) -> None:
    names = [m.model for m in client.list().models]
    assert names == [server.model, "all-MiniLM-L6-v2"]
    first = client.list().models[0]
    assert first.details.family == "llama" and first.details.quantization_level
    assert first.size > 0 and first.digest
    shown = client.show(server.model)
    assert "<|im_start|>" in shown.template and "completion" in shown.capabilities
    assert shown.modelinfo["context_length"] > 0
    assert [m.model for m in client.ps().models] == names
    assert httpx.get(f"{server.url}/api/version", timeout=10).json()["version"]


def test_chat_whole_and_streamed_agree(client, server: Server) -> None:
    options = {"temperature": 0, "num_predict": 12, "seed": 3}
    # The shared server's prefix cache holds whatever earlier tests sent: a first call puts this
    # prompt in it, so that the two compared below reuse the same cached prefix (a prefill over
    # fp16 cached keys and one over fresh ones can round a near-tie apart; that is the engine's
    # documented non-invariance, see --deterministic, not what this test is about).
    client.chat(model=server.model, messages=CHAT, options=options, stream=False)
    whole = client.chat(model=server.model, messages=CHAT, options=options, stream=False)
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.done and whole.done_reason == "length"
    assert whole.eval_count == 12 and whole.prompt_eval_count > 5
    assert whole.total_duration >= whole.eval_duration > 0
    parts = list(client.chat(model=f"{server.model}:latest", messages=CHAT, options=options,
                             stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content


def test_generate_raw_and_templated(client, server: Server) -> None:
    options = {"temperature": 0, "num_predict": 8}
    raw = client.generate(model=server.model, prompt="The capital of France is", raw=True,
                          options=options)
    assert raw.response and raw.eval_count == 8
    chat_like = client.generate(model=server.model, prompt="Name three rivers.",
                                options=options)
    chat = client.chat(model=server.model, messages=CHAT, options=options)
    assert chat_like.response == chat.message.content  # the template is applied
    stop = client.generate(model=server.model, prompt="Count: 1, 2, 3,", raw=True,
                           options={"temperature": 0, "num_predict": 30, "stop": [","]})
    assert "," not in stop.response and stop.done_reason == "stop"


def test_json_format(client, server: Server) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    out = client.chat(model=server.model, format=schema, options={"temperature": 0,
                                                                  "num_predict": 40},
                      messages=[{"role": "user", "content": "A city in France, as JSON."}])
    assert isinstance(json.loads(out.message.content)["city"], str)
    loose = client.generate(model=server.model, prompt="Give a JSON object.", format="json",
                            options={"temperature": 0, "num_predict": 60})
    # Any JSON object: a small model may still be writing it when num_predict runs out.
    assert loose.response.lstrip().startswith("{")
    if loose.done_reason == "stop":
        assert isinstance(json.loads(loose.response), dict)


def test_embeddings(client) -> None:
    out = client.embed(model="all-MiniLM-L6-v2", input=["a cat", "a dog"])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 384
    assert out.prompt_eval_count > 0
    one = client.embeddings(model="all-MiniLM-L6-v2", prompt="a cat")
    assert one.embedding == pytest.approx(list(out.embeddings[0]), abs=1e-5)


@pytest.mark.parametrize("path, body, words", [
    ("/api/chat", {"model": "nope", "messages": CHAT}, "nope"),
    ("/api/chat", {"model": "SERVER", "messages": []}, "messages"),
    ("/api/generate", {"model": "SERVER", "prompt": 5}, "prompt"),
    ("/api/generate", {"model": "SERVER", "prompt": "x", "options": {"num_predict": "ten"}},
     "num_predict"),
    ("/api/generate", {"model": "SERVER", "prompt": "x", "format": "yaml"}, "format"),
    ("/api/chat", {"model": "SERVER", "messages": [{"role": "user", "content": "x",
                                                    "images": ["aGk="]}]}, "images"),
    ("/api/embed", {"model": "all-MiniLM-L6-v2", "input": 3}, "input"),
    ("/api/embed", {"model": "SERVER", "input": "x"}, ""),
])
def test_bad_input_gets_an_ollama_error(server: Server, path: str, body: dict,
                                        words: str) -> None:
    body = json.loads(json.dumps(body).replace("SERVER", server.model))
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()) == {"error"} and words in r.json()["error"]


def test_the_client_raises_on_errors(client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=CHAT)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
