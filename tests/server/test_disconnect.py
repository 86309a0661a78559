"""A client that goes away aborts its request: running, KV usage and queue return to baseline."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from server_harness import Server, idle, wait_for

# As long as the test server's context allows (max_model_len 512): at a few hundred tokens/s
# it still runs for seconds, so only an abort ends it early.
LONG = {"prompt": "Tell me a very long story.", "max_tokens": 450, "ignore_eos": True}


def aborted(server: Server) -> float:
    return server.metrics().get("tokenmill:request_success_total[abort]", 0.0)


def ran_to_length(server: Server) -> float:
    return server.metrics().get("tokenmill:request_success_total[length]", 0.0)


def generated(server: Server) -> float:
    return server.metrics().get("tokenmill:generation_tokens_total", 0.0)


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


def body_for(path: str) -> dict:
    body = dict(LONG)
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": body.pop("prompt")}], **body}
    return body


def send_raw(server: Server, path: str, body: dict) -> socket.socket:
    """A connection with the whole request sent on it, its answer not read."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(head + payload)
    return sock


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_disconnect_aborts(server: Server, path: str) -> None:
    assert wait_for(lambda: idle(server))
    before, tokens_before = aborted(server), generated(server)
    with send_raw(server, path, body_for(path)):
        # Hang up only once the request is running (however slow the machine is).
        assert wait_for(lambda: server.metrics()["tokenmill:num_requests_running"] == 1)
    # 450 tokens take far longer than this: only an abort gets the server idle in time.
    assert wait_for(lambda: idle(server), timeout=10), server.metrics()
    assert aborted(server) == before + 1
    assert generated(server) - tokens_before < LONG["max_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions"])
def test_client_gone_before_the_request_is_queued(server: Server, path: str) -> None:
    """The whole request arrives and the client hangs up at once, so the server sees the
    disconnect while it is still preparing the request (or before it reads the body). Either
    the request is never queued or it is aborted: it must not run its 450 tokens to the end."""
    assert wait_for(lambda: idle(server))
    length_before, tokens_before = ran_to_length(server), generated(server)
    body = body_for(path)
    for _ in range(3):
        send_raw(server, path, body).close()
    assert wait_for(lambda: idle(server), timeout=30), server.metrics()
    assert ran_to_length(server) == length_before
    assert generated(server) - tokens_before < LONG["max_tokens"]
    # The server is fine afterwards.
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
