"""A small server (2 running + 2 queued sequences, API key from the environment): auth,
overload with Retry-After, and a queued request whose client disconnects."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_harness import Server, idle, start_server, wait_for

KEY = "test-key-5b1f"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def small() -> Iterator[Server]:
    s = start_server("--max-num-seqs", "2", "--max-queue", "2",
                     env={"TOKENMILL_API_KEY": KEY}, headers=AUTH)
    yield s
    assert s.stop() == 0, s.log()


ROUTES = [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_auth_on_every_inference_and_admin_route(small: Server, method: str, path: str,
                                                 body: dict | None) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY + "x"}):
        r = httpx.request(method, f"{small.url}{path}", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, f"{small.url}{path}", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


def test_health_and_metrics_open(small: Server) -> None:
    assert httpx.get(f"{small.url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{small.url}/metrics", timeout=5).status_code == 200


def test_openai_client_auth(small: Server) -> None:
    good = openai.OpenAI(base_url=f"{small.url}/v1", api_key=KEY, max_retries=0)
    out = good.completions.create(model=small.model, prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=f"{small.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=small.model, prompt="hi", max_tokens=2)


def test_overload_gets_503_with_retry_after(small: Server) -> None:
    assert wait_for(lambda: idle(small))
    body = {"prompt": "Count to ten:", "max_tokens": 24, "ignore_eos": True}

    def call(_: int) -> httpx.Response:
        return httpx.post(f"{small.url}/v1/completions", json=body, headers=AUTH, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(call, range(8)))
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(rejected) == 8, [r.text for r in responses]
    assert len(ok) >= 4 and rejected  # 2 running + 2 queued fit; the rest must not
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
    for r in ok:  # admitted requests complete in full
        assert r.json()["usage"]["completion_tokens"] == 24
    assert wait_for(lambda: idle(small))


def test_queued_request_disconnect(small: Server) -> None:
    assert wait_for(lambda: idle(small))
    before = small.metrics().get("tokenmill:request_success_total[abort]", 0.0)
    with httpx.Client(timeout=60, headers=AUTH) as http:
        running = [http.stream("POST", f"{small.url}/v1/completions", json=LONG)
                   for _ in range(2)]
        for r in running:
            r.__enter__()
        assert wait_for(lambda: small.metrics()["tokenmill:num_requests_running"] == 2)
        with httpx.Client(timeout=60, headers=AUTH) as other:
            queued = other.stream("POST", f"{small.url}/v1/completions", json=LONG)
            queued.__enter__()
            assert wait_for(lambda: small.metrics()["tokenmill:num_requests_waiting"] == 1)
            queued.__exit__(None, None, None)
        assert wait_for(lambda: small.metrics()["tokenmill:num_requests_waiting"] == 0)
        assert small.metrics()["tokenmill:num_requests_running"] == 2
        for r in running:
            r.__exit__(None, None, None)
    assert wait_for(lambda: idle(small), timeout=10), small.metrics()
    assert small.metrics()["tokenmill:request_success_total[abort]"] == before + 3
