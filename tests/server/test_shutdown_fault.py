"""SIGTERM drains then aborts and exits 0; a failing engine step fails its requests, turns
/health to 503 and exits non-zero. Each test owns its server process (it ends it)."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import openai
import pytest
from server_harness import Server, start_server, wait_for

# Long enough for the 24-token request to finish beside two others on a slow 2-core CPU in
# fp32 (4 s was not, on an AVX2-only EPYC), far too short for the 450-token ones.
DRAIN_S = 12


def stream_events(server: Server, body: dict) -> list[str]:
    """Every SSE data payload of one streamed completion."""
    out = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line.removeprefix("data: "))
    return out


def finish_reasons(events: list[str]) -> list[str]:
    return [c["finish_reason"] for e in events if e != "[DONE]"
            for c in json.loads(e)["choices"] if c["finish_reason"]]


def test_sigterm_drains_then_aborts_and_exits_0() -> None:
    # fp32 weights (slower than the default int4) so that the short request is still running
    # when all three are counted, and the long ones cannot finish within the drain window.
    s = start_server("--drain-timeout", str(DRAIN_S), "--quantization", "none")
    short = {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True}
    long = {"prompt": "Tell me a very long story.", "max_tokens": 450, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        f_short = pool.submit(stream_events, s, short)
        f_long = pool.submit(stream_events, s, long)
        f_whole: Future[httpx.Response] = pool.submit(
            httpx.post, f"{s.url}/v1/completions", json=long, timeout=120)
        assert wait_for(lambda: s.metrics()["tokenmill:num_requests_running"] == 3)
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: httpx.get(f"{s.url}/health", timeout=5).status_code == 503,
                        timeout=5)
        r = httpx.post(f"{s.url}/v1/completions", json=short, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        # Requests that can finish in the drain window do; the rest end as "abort".
        assert finish_reasons(f_short.result()) == ["length"]
        long_events = f_long.result()
        assert long_events[-1] == "[DONE]" and finish_reasons(long_events) == ["abort"]
        whole = f_whole.result()
        assert whole.status_code == 200
        assert whole.json()["choices"][0]["finish_reason"] == "abort"
    assert s.proc.wait(30) == 0, s.log()
    assert time.monotonic() - start < DRAIN_S + 15


def test_engine_fault_fails_requests_and_exits_nonzero() -> None:
    s = start_server("--debug-fail-at-step", "10")
    long = {"prompt": "Tell me a very long story.", "max_tokens": 200, "ignore_eos": True}
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)

    def streamed() -> tuple[str, str]:
        text = ""
        with pytest.raises(openai.APIError) as info:
            for chunk in client.completions.create(
                    model=s.model, prompt=long["prompt"], max_tokens=long["max_tokens"],
                    stream=True, extra_body={"ignore_eos": True}):
                text += chunk.choices[0].text if chunk.choices else ""
        return text, str(info.value)

    try:
        with ThreadPoolExecutor(2) as pool:
            f_stream = pool.submit(streamed)
            f_whole = pool.submit(httpx.post, f"{s.url}/v1/completions", json=long, timeout=60)
            whole = f_whole.result()
            assert whole.status_code == 500, whole.text
            assert whole.json()["error"]["code"] == "engine_error"
            assert httpx.get(f"{s.url}/health", timeout=5).status_code == 503
            text, error = f_stream.result()
            assert text and "InjectedFaultError" in error  # tokens first, then the error event
        # The process exits non-zero so that a supervisor restarts a clean engine.
        assert s.proc.wait(30) == 1, s.log()
        assert "debug_fail_at_step=10" in s.log()
    finally:
        s.stop(signal.SIGKILL)
