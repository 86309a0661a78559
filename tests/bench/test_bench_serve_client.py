"""The load generator's client side, against in-process fake servers (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
import statistics

import httpx
import pytest

from tokenmill.bench import serve
from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.serve import LoadSpec, arrivals, payload, send_request

REQ = SampleRequest("a prompt", prompt_len=2, output_len=5)


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def run(handler, spec: LoadSpec | None = None, req: SampleRequest = REQ):
    spec = spec or LoadSpec(base_url="http://fake", model="m", requests=[req])

    async def go():
        async with httpx.AsyncClient(base_url="http://fake",
                                     transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, spec, req)

    return asyncio.run(go())


def test_payload_asks_for_usage_and_fixed_lengths() -> None:
    spec = LoadSpec(base_url="x", model="m", requests=[REQ], extra_body={"top_k": 1})
    body = payload(spec, REQ, 5)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5 and body["top_k"] == 1
    assert "min_tokens" not in body
    spec = LoadSpec(base_url="x", model="m", requests=[REQ], ignore_eos=False, min_tokens=True)
    body = payload(spec, REQ, 5)
    assert "ignore_eos" not in body and body["min_tokens"] == 5


def test_usage_chunk_gives_the_token_count() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        # Three content chunks carrying five tokens; an empty chunk is not content.
        body = sse(chunk("one two"), chunk(""), chunk(" three"), chunk(" four five"),
                   {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5}})
        return httpx.Response(200, content=body)

    r = run(handler)
    assert r.success and not r.error
    assert seen[0]["prompt"] == "a prompt"
    assert r.output_tokens == 5
    assert len(r.itl) == 2  # gaps between 3 content chunks
    assert 0 < r.ttft <= r.latency and r.end_time >= r.start_time


def test_without_usage_the_content_chunks_are_counted() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse(*[chunk(f" t{i}") for i in range(4)]))

    r = run(handler)
    assert r.success and r.output_tokens == 4 and len(r.itl) == 3


def test_chat_style_deltas_count_as_content() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        delta = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
        return httpx.Response(200, content=sse(delta, delta))

    assert run(handler).output_tokens == 2


@pytest.mark.parametrize("response, message", [
    (httpx.Response(400, json={"error": {"message": "bad max_tokens"}}), "HTTP 400"),
    (httpx.Response(200, content=sse(chunk("x"), {"error": {"message": "engine died"}})),
     "engine died"),
    (httpx.Response(200, content=sse()), "without content"),
])
def test_failures_are_recorded_not_raised(response: httpx.Response, message: str) -> None:
    r = run(lambda request: response)
    assert not r.success and message in r.error


def test_connection_errors_are_recorded() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    r = run(handler)
    assert not r.success and "ConnectError" in r.error


def _gaps(monkeypatch: pytest.MonkeyPatch, rate: float, burstiness: float, seed: int,
          n: int = 2000) -> list[float]:
    """The sleeps ``arrivals`` takes (recorded instead of slept)."""
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(serve.asyncio, "sleep", fake_sleep)
    reqs = [REQ] * n

    async def collect() -> int:
        return len([r async for r in arrivals(reqs, rate, burstiness, seed)])

    assert asyncio.run(collect()) == n
    return slept


def test_poisson_arrivals_are_seeded_with_mean_one_over_rate(monkeypatch) -> None:
    a = _gaps(monkeypatch, rate=4.0, burstiness=1.0, seed=1)
    assert a == _gaps(monkeypatch, rate=4.0, burstiness=1.0, seed=1)
    assert a != _gaps(monkeypatch, rate=4.0, burstiness=1.0, seed=2)
    assert len(a) == 1999  # no wait before the first request
    assert statistics.fmean(a) == pytest.approx(0.25, rel=0.1)
    # Exponential gaps: the standard deviation equals the mean; steadier with burstiness > 1.
    assert statistics.pstdev(a) == pytest.approx(0.25, rel=0.15)
    steady = _gaps(monkeypatch, rate=4.0, burstiness=10.0, seed=1)
    assert statistics.pstdev(steady) < statistics.pstdev(a) / 2


def test_infinite_rate_sends_all_at_once(monkeypatch) -> None:
    assert _gaps(monkeypatch, rate=float("inf"), burstiness=1.0, seed=0, n=10) == []


@pytest.mark.parametrize("field, value", [("request_rate", 0.0), ("burstiness", -1.0),
                                          ("max_concurrency", 0)])
def test_run_load_validates(field: str, value: float) -> None:
    spec = LoadSpec(base_url="http://fake", model="m", requests=[REQ], **{field: value})
    with pytest.raises(ValueError, match=field):
        serve.run_load(spec)
