"""Ollama's ``think``: the thinking model's thinking answered as ``message.thinking`` (and
/api/generate's ``thinking``), the same split as /v1/chat/completions makes."""

from __future__ import annotations

import json
from typing import Any

import httpx
from thinking_model import Server

ASK = [{"role": "user", "content": "t7 t9"}]


def ollama(server: Server, path: str, **body: Any) -> httpx.Response:
    body = {"model": "thinker", "options": {"temperature": 0, "num_predict": 8}, **body}
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def openai_message(server: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "thinker", "messages": ASK, "temperature": 0, "max_tokens": 8, **body})
    return r.json()["choices"][0]["message"]


def test_chat_answers_the_thinking_apart(server: Server) -> None:
    expected = openai_message(server)  # the server's default budget (4) ends the thinking
    whole = ollama(server, "/api/chat", messages=ASK, think=True, stream=False).json()
    assert whole["message"]["thinking"] == expected["reasoning_content"]
    assert whole["message"]["content"] == (expected["content"] or "")
    lines = [json.loads(line) for line in ollama(
        server, "/api/chat", messages=ASK, think=True).text.splitlines()]
    assert "".join(x["message"].get("thinking", "") for x in lines) == \
        expected["reasoning_content"]
    assert "".join(x["message"]["content"] for x in lines) == whole["message"]["content"]
    generated = ollama(server, "/api/generate", prompt="t7 t9", stream=False).json()
    assert generated["thinking"] == expected["reasoning_content"]


def test_think_false_turns_the_thinking_off(server: Server) -> None:
    expected = openai_message(server, chat_template_kwargs={"enable_thinking": False})
    whole = ollama(server, "/api/chat", messages=ASK, think=False, stream=False).json()
    assert "thinking" not in whole["message"]
    assert whole["message"]["content"] == expected["content"]


def test_think_for_a_model_that_does_not_think_is_refused(server: Server) -> None:
    r = ollama(server, "/api/chat", model="smol", messages=ASK, think=True, stream=False)
    assert r.status_code == 400 and "think" in r.json()["error"]
    bad = ollama(server, "/api/chat", messages=ASK, think="very", stream=False)
    assert bad.status_code == 400 and "think" in bad.json()["error"]
    # think false on it is harmless, and the next request is answered.
    ok = ollama(server, "/api/chat", model="smol", messages=ASK, think=False, stream=False)
    assert ok.status_code == 200 and ok.json()["done"] is True
