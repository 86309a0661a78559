"""Every bad input gets a 4xx with an OpenAI error body and never reaches the engine."""

from __future__ import annotations

import httpx
import pytest
from server_harness import Server

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
VOCAB = 49152  # SmolLM2's vocabulary
MSGS = [{"role": "user", "content": "hi"}]

# (name, path, JSON body or raw bytes, expected status, expected param or None)
CASES: list[tuple[str, str, dict | bytes, int, str | None]] = [
    ("empty prompt", CMPL, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", CMPL, {"prompt": []}, 400, "prompt"),
    ("empty token list in batch", CMPL, {"prompt": [[]]}, 400, "prompt"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("message without role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("message content wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages"),
    ("prompt + max_tokens over context", CMPL, {"prompt": "hello", "max_tokens": 600}, 400,
     "max_tokens"),
    ("chat over context", CHAT, {"messages": MSGS, "max_completion_tokens": 600}, 400,
     "max_completion_tokens"),
    ("prompt alone over context", CMPL, {"prompt": "word " * 600}, 400, "prompt"),
    ("negative token id", CMPL, {"prompt": [1, -1]}, 400, "prompt"),
    ("token id = vocab size", CMPL, {"prompt": [1, VOCAB]}, 400, "prompt"),
    ("NaN temperature", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("infinite top_p", CMPL, b'{"prompt": "hi", "top_p": Infinity}', 400, None),
    ("huge float temperature", CMPL, {"prompt": "hi", "temperature": 1e308}, 400, "temperature"),
    ("negative temperature", CMPL, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("temperature as string", CMPL, {"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ("top_p zero", CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("top_k negative", CMPL, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("min_p above one", CMPL, {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("repetition_penalty zero", CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("presence_penalty too big", CHAT, {"messages": MSGS, "presence_penalty": 3}, 400,
     "presence_penalty"),
    ("frequency_penalty wrong type", CHAT, {"messages": MSGS, "frequency_penalty": [1]}, 400,
     "frequency_penalty"),
    ("negative seed", CMPL, {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("max_tokens zero", CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens float", CMPL, {"prompt": "hi", "max_tokens": 5.5}, 400, "max_tokens"),
    ("n zero", CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    ("huge n", CHAT, {"messages": MSGS, "n": 100000}, 400, "n"),
    ("n as bool", CHAT, {"messages": MSGS, "n": True}, 400, "n"),
    ("thousands of stop strings", CMPL, {"prompt": "hi", "stop": ["x"] * 5000}, 400, "stop"),
    ("empty stop string", CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("logit_bias key out of vocab", CMPL, {"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, 400,
     "logit_bias"),
    ("logit_bias key not a number", CHAT, {"messages": MSGS, "logit_bias": {"abc": 1}}, 400,
     "logit_bias"),
    ("logit_bias value too big", CMPL, {"prompt": "hi", "logit_bias": {"5": 1000}}, 400,
     "logit_bias"),
    ("top_logprobs too many", CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSGS, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("completion logprobs too many", CMPL, {"prompt": "hi", "logprobs": 30}, 400, "logprobs"),
    ("unknown model", CMPL, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("malformed JSON", CMPL, b'{"prompt": "hi",', 400, None),
    ("invalid UTF-8", CMPL, b'{"prompt": "\xff\xfe"}', 400, None),
    ("body not an object", CHAT, b"[1, 2, 3]", 400, None),
    ("missing prompt", CMPL, {"max_tokens": 4}, 400, "prompt"),
    ("body over the size limit", CMPL, {"prompt": "a" * (5 << 20)}, 413, None),
    ("bad detokenize ids", "/detokenize", {"tokens": [VOCAB + 5]}, 400, "tokens"),
]


def post(server: Server, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{path}", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def engine_counters(server: Server) -> tuple[float, float]:
    m = server.metrics()
    finished = sum(v for k, v in m.items() if k.startswith("tokenmill:request_finished_total"))
    return finished, m["tokenmill:prompt_tokens_total"]


@pytest.mark.parametrize(("path", "body", "status", "param"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(server: Server, path: str, body: dict | bytes, status: int,
                   param: str | None) -> None:
    before = engine_counters(server)
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    # Rejected before the engine: it neither finished nor prefilled anything.
    assert engine_counters(server) == before


def test_engine_unharmed(server: Server) -> None:
    r = httpx.get(f"{server.url}/health", timeout=5)
    assert r.status_code == 200
    r = post(server, CMPL, {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_unknown_route_and_method(server: Server) -> None:
    r = httpx.get(f"{server.url}/v1/nothing", timeout=5)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{server.url}{CMPL}", timeout=5)
    assert r.status_code == 405 and "error" in r.json()
