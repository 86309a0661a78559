"""Bad Responses requests: each a 400 (or 404) with OpenAI's error body naming the field, and
the next request is served as if nothing happened."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_harness import Server

FN = {"type": "function", "name": "f", "parameters": {"type": "object"}}

# (body fields, the field the 400 names, a word of its message)
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input", "role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "text only"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "3"}]},
     "input", "call_1"),
    ({"input": [{"role": "user", "content": 5}]}, "input", "content"),
    ({"input": 5}, "input", "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools", "name"),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools", "vector_store_ids"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"],
                                "max_num_results": 51}]}, "tools", "max_num_results"),
    ({"input": "hi", "tools": [FN], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", "'g'"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "tools"),
    ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"input": "hi", "include": ["file_search_call.everything"]}, "include", "include[0]"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens", "context"),
    ({"input": "hi", "temperature": "hot"}, "temperature", "temperature"),
    ({"input": "hi", "top_p": 0}, "top_p", "top_p"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
    ({"input": "hi", "background": True}, "background", "background"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text",
     "schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "objec"}}}},
     "text", "Unsupported type"),
    ({"input": "hi", "top_logprobs": 50, "include": ["message.output_text.logprobs"]},
     "top_logprobs", "top_logprobs"),
    ({"input": "x " * 5000}, "input", "context"),
]


@pytest.mark.parametrize(("fields", "param", "word"), BAD,
                         ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_request_is_400_naming_the_field(server: Server, fields: dict[str, Any],
                                             param: str, word: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": server.model, **fields},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert word.lower() in error["message"].lower(), error
    # Nothing was lost: the next request is answered.
    ok = httpx.post(f"{server.url}/v1/responses", timeout=60,
                    json={"model": server.model, "input": "Hi", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete"), ok.text


def test_unknown_ids_are_404(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_nope"]}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "tools"
    assert "vs_nope" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/responses/resp_nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.delete(f"{server.url}/v1/responses/resp_nothing", timeout=10)
    assert r.status_code == 404
    r = httpx.post(f"{server.url}/v1/responses", timeout=10,
                   json={"input": "hi", "previous_response_id": "resp_nothing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(f"{server.url}/v1/responses", timeout=10,
                   json={"model": "another-model", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_malformed_bodies(server: Server) -> None:
    url = f"{server.url}/v1/responses"
    r = httpx.post(url, content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"input=hi", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = httpx.post(url, json={"model": server.model})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
