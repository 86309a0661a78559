"""Per-project limits over HTTP: requests and tokens per minute, concurrent requests and the
monthly budget answer 429 with OpenAI's x-ratelimit-* headers and Retry-After; other projects
and the server key are not touched; a changed limit applies to the next request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tenancy_harness import SERVER_KEY, Server, admin, new_key, new_project, start


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A price high enough that one short request costs more than a tiny budget.
    s = start(Path(tmp_path_factory.mktemp("data")), "--cost-per-hour", "3600000")
    yield s
    s.stop()


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def complete(server: Server, key: str, max_tokens: int = 3) -> openai.types.Completion:
    return client(server, key).completions.create(
        model=server.model, prompt="hello there", max_tokens=max_tokens, temperature=0)


def key_of(server: Server, **limits: object) -> tuple[str, str]:
    pid = new_project(server, **limits)
    return pid, new_key(server, pid)["value"]


def test_requests_per_minute(server: Server) -> None:
    _, key = key_of(server, max_requests_per_1_minute=2)
    raw = client(server, key).completions.with_raw_response.create(
        model=server.model, prompt="hi", max_tokens=2)
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"  # after this one
    complete(server, key)
    with pytest.raises(openai.RateLimitError) as e:
        complete(server, key)
    headers = e.value.response.headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(headers["retry-after"]) <= 60
    assert "2 requests per minute" in e.value.message
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'tokenmill:project_rate_limited_total{code="rate_limit_exceeded",project="' in metrics
    # Another project and the server key are not limited by it.
    assert complete(server, key_of(server)[1]).choices
    assert complete(server, SERVER_KEY).choices


def test_tokens_per_minute(server: Server) -> None:
    _, key = key_of(server, max_tokens_per_1_minute=5)
    complete(server, key, max_tokens=4)  # prompt and completion tokens: more than 5
    with pytest.raises(openai.RateLimitError) as e:
        complete(server, key)
    assert e.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
    assert "5 tokens per minute" in e.value.message


def test_concurrent_requests(server: Server) -> None:
    _, key = key_of(server, max_concurrent_requests=1)
    started, release = threading.Event(), threading.Event()
    body = {"model": server.model, "prompt": "a long story", "max_tokens": 64,
            "ignore_eos": True, "stream": True}

    def hold_a_stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            started.set()
            release.wait(60)

    t = threading.Thread(target=hold_a_stream)
    t.start()
    try:
        assert started.wait(60)
        with pytest.raises(openai.RateLimitError) as e:
            complete(server, key)
        assert "1 concurrent requests" in e.value.message
    finally:
        release.set()
        t.join(120)
    assert complete(server, key).choices  # its slot is free again


def test_monthly_budget(server: Server) -> None:
    pid, key = key_of(server, monthly_budget=1e-9)
    complete(server, key)  # nothing spent yet: it runs, and costs more than the budget
    with pytest.raises(openai.RateLimitError) as e:
        complete(server, key)
    assert e.value.code == "insufficient_quota" and "monthly budget" in e.value.message
    # Raising the budget opens it at once.
    r = admin(server, "POST", f"/projects/{pid}", json={"monthly_budget": 1e6})
    assert r.status_code == 200 and r.json()["monthly_budget"] == 1e6
    assert complete(server, key).choices


def test_raised_limit_applies_to_the_next_request(server: Server) -> None:
    pid, key = key_of(server, max_requests_per_1_minute=1)
    complete(server, key)
    with pytest.raises(openai.RateLimitError):
        complete(server, key)
    admin(server, "POST", f"/projects/{pid}", json={"max_requests_per_1_minute": 10})
    assert complete(server, key).choices
    # null removes a limit.
    r = admin(server, "POST", f"/projects/{pid}", json={"max_requests_per_1_minute": None})
    assert r.json()["max_requests_per_1_minute"] is None


def test_stream_that_crosses_the_budget_ends_with_length(server: Server) -> None:
    # At this price a step costs about 1-100 units: the budget lasts a few steps.
    _, key = key_of(server, monthly_budget=50)
    stream = client(server, key).completions.create(
        model=server.model, prompt="a long story", max_tokens=400, stream=True,
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length"
    assert getattr(last, "stop_reason", None) == "the project's monthly budget is spent"
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) < 400
    # And the next request is refused: the budget is spent.
    with pytest.raises(openai.RateLimitError):
        complete(server, key)
