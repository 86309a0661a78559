"""A client that goes away aborts its request: running, KV usage and queue return to baseline."""

from __future__ import annotations

import httpx
import pytest
from server_harness import Server, idle, wait_for

# As long as the test server's context allows (max_model_len 512): at a few hundred tokens/s
# it still runs for seconds, so only an abort ends it early.
LONG = {"prompt": "Tell me a very long story.", "max_tokens": 450, "ignore_eos": True}


def aborted(server: Server) -> float:
    return server.metrics().get("tokenmill:request_finished_total[abort]", 0.0)


def test_streaming_disconnect_aborts(server: Server) -> None:
    assert wait_for(lambda: idle(server))
    before = aborted(server)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions",
                         json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            # Keep the iterator alive: dropping it mid-body closes the connection.
            lines = r.iter_lines()
            events = 0
            while events < 3:
                events += next(lines).startswith("data: ")
            assert server.metrics()["tokenmill:num_requests_running"] == 1
            assert server.metrics()["tokenmill:kv_cache_usage_perc"] > 0
    # Leaving the block closed the connection mid-stream.
    assert wait_for(lambda: idle(server), timeout=10), server.metrics()
    assert aborted(server) == before + 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_disconnect_aborts(server: Server, path: str) -> None:
    assert wait_for(lambda: idle(server))
    before = aborted(server)
    body = dict(LONG)
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": body.pop("prompt")}], **body}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{path}", json=body, timeout=httpx.Timeout(30, read=0.5))
    # 400 tokens take far longer than this: only an abort gets the server idle in time.
    assert wait_for(lambda: idle(server), timeout=10), server.metrics()
    assert aborted(server) == before + 1
