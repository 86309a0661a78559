"""Ollama's routes against malformed input (a 4xx with Ollama's ``{"error": "..."}``, never a
500, and the next request answered as before), /api/generate's ``context`` round trip, and
what /api/tags and /api/show say about the model's file."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from server_harness import Server

from tokenmill.model_loader.gguf import embedded_model_path

ollama = pytest.importorskip("ollama")

GREEDY = {"temperature": 0, "num_predict": 6}
CHAT = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def client(server: Server):
    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def baseline(client, server: Server) -> str:
    """A normal chat answer, which every check below must get again after its bad request."""
    client.chat(model=server.model, messages=CHAT, options=GREEDY)  # see test_ollama.py
    return client.chat(model=server.model, messages=CHAT, options=GREEDY).message.content


def answered_as_before(client, server: Server, baseline: str) -> None:
    again = client.chat(model=server.model, messages=CHAT, options=GREEDY)
    assert again.message.content == baseline


def post(server: Server, path: str, body: dict | str, **headers: str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json", **headers})


def assert_ollama_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and words in r.json()["error"], r.text


@pytest.mark.parametrize("calls", [
    "abc", [1], [{"function": "x"}], {"function": {"name": "f"}}, [{"name": "f"}],
    [{"function": {"name": 3}}], [{"function": {"name": ""}}],
    [{"function": {"name": "f", "arguments": "x"}}]])
def test_malformed_tool_calls_are_a_400(client, server: Server, baseline: str,
                                        calls: object) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "user", "content": "Thanks."}]
    r = post(server, "/api/chat", {"model": server.model, "messages": messages})
    assert_ollama_error(r, 400, "messages[1].tool_calls")
    answered_as_before(client, server, baseline)


def test_well_formed_tool_calls_and_results_pass(client, server: Server) -> None:
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"function": {"name": "get_time", "arguments": {}}}]
    # Ollama's tool results carry no call id: at most the function's name.
    for results in ([{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "9am"}],
                    [{"role": "tool", "content": "9am", "tool_name": "get_time"},
                     {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]):
        messages = [*CHAT, {"role": "assistant", "content": "", "tool_calls": calls}, *results]
        out = client.chat(model=server.model, messages=messages, options=GREEDY)
        assert out.done and out.eval_count > 0


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/api/embed", "/api/show",
                                  "/api/embeddings"])
def test_a_deeply_nested_body_is_a_400(client, server: Server, baseline: str,
                                       path: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    r = post(server, path, f'{{"model": "{server.model}", "messages": {deep}}}')
    assert_ollama_error(r, 400, "nested more than 64 levels")
    answered_as_before(client, server, baseline)


@pytest.mark.parametrize("body, words", [
    ('{"model": "m", "prompt": "x", "options": {"temperature": NaN}}', "NaN"),
    ('{"model": "m", "prompt": "x", "options": {"top_p": Infinity}}', "Infinity"),
    ('{"model": "m", "prompt": "x"', "not valid JSON"),
    (b'{"model": "\xff"}'.decode("latin-1"), "UTF-8"),
])
def test_non_strict_json_is_a_400(client, server: Server, baseline: str, body: str,
                                  words: str) -> None:
    content = body.encode("latin-1") if "\xff" in body else body.encode()
    r = httpx.post(f"{server.url}/api/generate", content=content, timeout=60,
                   headers={"content-type": "application/json"})
    assert_ollama_error(r, 400, words)
    answered_as_before(client, server, baseline)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          None])
@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/api/show"])
def test_a_body_not_declared_json_is_a_415(client, server: Server, baseline: str,
                                           path: str, content_type: str | None) -> None:
    body = json.dumps({"model": server.model, "messages": CHAT, "prompt": "x"})
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=60)
    assert_ollama_error(r, 415, "Content-Type: application/json")
    answered_as_before(client, server, baseline)


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/api/nope", 404), ("POST", "/api/pull", 404), ("GET", "/api/chat", 405),
    ("DELETE", "/api/tags", 405)])
def test_unknown_routes_get_an_ollama_error(client, server: Server, baseline: str, method: str,
                                            path: str, status: int) -> None:
    r = httpx.request(method, f"{server.url}{path}", timeout=30)
    assert r.status_code == status and set(r.json()) == {"error"}, r.text
    assert isinstance(r.json()["error"], str) and r.headers["x-request-id"]
    # The /v1 routes keep OpenAI's shape.
    assert set(httpx.get(f"{server.url}/v1/nope", timeout=30).json()["error"]) >= {"message"}
    answered_as_before(client, server, baseline)


def tokenize(server: Server, **body: object) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": server.model, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def complete_ids(server: Server, ids: list[int], max_tokens: int) -> str:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": server.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_raw_generate_returns_context_and_takes_it_back(client, server: Server) -> None:
    prompt = "The capital of France is"
    first = client.generate(model=server.model, prompt=prompt, raw=True, options=GREEDY)
    prompt_ids = tokenize(server, prompt=prompt)
    assert first.context[:len(prompt_ids)] == prompt_ids
    assert len(first.context) == len(prompt_ids) + first.eval_count
    streamed = list(client.generate(model=server.model, prompt=prompt, raw=True,
                                    options=GREEDY, stream=True))
    assert streamed[-1].context == first.context
    assert not any(p.context for p in streamed[:-1])

    more = " Its river is"
    second = client.generate(model=server.model, prompt=more, raw=True, options=GREEDY,
                             context=first.context)
    more_ids = tokenize(server, prompt=more, add_special_tokens=False)
    assert second.prompt_eval_count == len(first.context) + len(more_ids)
    assert second.context[:len(first.context)] == first.context
    assert second.response == complete_ids(server, [*first.context, *more_ids], 6)


def test_templated_generate_continues_from_context(client, server: Server) -> None:
    first = client.generate(model=server.model, prompt="Name a river.", options=GREEDY)
    assert len(first.context) == first.prompt_eval_count + first.eval_count
    second = client.generate(model=server.model, prompt="Another one.", options=GREEDY,
                             context=first.context)
    turn = tokenize(server, messages=[{"role": "user", "content": "Another one."}])
    assert second.prompt_eval_count == len(first.context) + len(turn)
    assert second.context[:len(first.context)] == first.context
    assert second.response == complete_ids(server, [*first.context, *turn], 6)


@pytest.mark.parametrize("context", ["abc", {"a": 1}, [1.5], ["1"], [True], [-1], [10**9],
                                     [1, None]])
def test_a_bad_context_is_a_400_naming_it(client, server: Server, baseline: str,
                                          context: object) -> None:
    r = post(server, "/api/generate", {"model": server.model, "prompt": "x",
                                       "context": context})
    assert_ollama_error(r, 400, "context")
    answered_as_before(client, server, baseline)


def test_tags_and_show_report_the_file_not_its_place(client, server: Server) -> None:
    path = embedded_model_path()
    size = os.path.getsize(path)
    tags = {m.model: m for m in client.list().models}
    assert tags[server.model].size == size
    assert 0 < tags["all-MiniLM-L6-v2"].size < 200 << 20  # its model.safetensors (~90 MB)
    shown = post(server, "/api/show", {"model": server.model}).json()
    assert shown["modelfile"] == f"FROM {os.path.basename(path)}\n"
    assert shown["size"] == size
    assert os.path.dirname(path) not in json.dumps(shown)
    # /api/ps still reports what the model holds in memory (weights and KV cache).
    assert {m.model: m.size for m in client.ps().models}[server.model] > size
