"""An exception no route handles: the app as ``build_app`` wires it, served by uvicorn on a
thread, answers a 500 with the API's error body and an ``x-request-id``, and the client's
keep-alive connection carries its next request as before."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from server_harness import free_port

from tokenmill.config import ServerConfig
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server import ollama_routes
from tokenmill.server.app import build_app
from tokenmill.server.state import ServedModel, ServerState


@pytest.fixture(scope="module")
def app_server() -> Iterator[tuple[str, ServerState]]:
    """The app over one fake model (no engine: the routes used here never reach one)."""
    fake = SimpleNamespace(num_seqs_in_flight=0, engine=SimpleNamespace(lora_enabled=False))
    state = ServerState(ServerConfig(), {"m": ServedModel("m", fake)},  # type: ignore[arg-type]
                        PrometheusMetrics())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port,
                                           log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the in-process server did not start"
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(30)
    state.workers.shutdown(wait=False)


def _client_port(response: httpx.Response) -> int:
    """The local port of the connection that carried ``response``."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def _boom(*_: object) -> None:
    raise RuntimeError("injected failure")


def test_a_crash_is_a_500_and_the_connection_stays_usable(
        app_server: tuple[str, ServerState], monkeypatch: pytest.MonkeyPatch) -> None:
    url, state = app_server
    with httpx.Client(base_url=url, timeout=10) as client:
        before = client.get("/version")
        assert before.status_code == 200
        monkeypatch.setattr(state.metrics, "render", _boom)
        crash = client.get("/metrics", headers={"x-request-id": "crash-1"})
        assert crash.status_code == 500
        assert crash.json()["error"]["message"] == "internal error: RuntimeError"
        assert crash.json()["error"]["type"] == "server_error"
        assert crash.headers["x-request-id"] == "crash-1"
        monkeypatch.undo()
        after = client.get("/version")
        # Answered as before, on the same connection.
        assert after.status_code == 200 and after.json() == before.json()
        assert _client_port(after) == _client_port(crash) == _client_port(before)
        assert client.get("/metrics").status_code == 200


def test_an_ollama_route_crash_is_an_ollama_500(
        app_server: tuple[str, ServerState], monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = app_server
    with httpx.Client(base_url=url, timeout=10) as client:
        monkeypatch.setattr(ollama_routes, "_entry", _boom)
        crash = client.get("/api/tags")
        assert crash.status_code == 500 and crash.json() == {"error":
                                                             "internal error: RuntimeError"}
        assert crash.headers["x-request-id"]
        after = client.get("/api/version")
        assert after.status_code == 200 and after.json()["version"]
        assert _client_port(after) == _client_port(crash)


def test_a_refused_host_has_a_request_id(app_server: tuple[str, ServerState]) -> None:
    url, _ = app_server
    r = httpx.get(f"{url}/version", headers={"host": "evil.example", "x-request-id": "h-1"},
                  timeout=10)
    assert r.status_code == 400 and r.headers["x-request-id"] == "h-1"
    assert r.json()["error"]["param"] == "host"
    ollama = httpx.get(f"{url}/api/tags", headers={"origin": "http://evil.example"},
                       timeout=10)
    assert ollama.status_code == 403 and "origin" in ollama.json()["error"]
    assert ollama.headers["x-request-id"]


def test_auth_errors_under_api_are_ollama_errors() -> None:
    fake = SimpleNamespace(num_seqs_in_flight=0, engine=SimpleNamespace(lora_enabled=False))
    state = ServerState(ServerConfig(allowed_hosts=("*",), api_key="k"),
                        {"m": ServedModel("m", fake)}, PrometheusMetrics())  # type: ignore[arg-type]
    client = TestClient(build_app(state))
    refused = client.get("/api/tags")
    assert refused.status_code == 401 and "API key" in refused.json()["error"]
    assert client.get("/api/version", headers={"authorization": "Bearer k"}).status_code == 200
    assert client.get("/v1/models").json()["error"]["code"] == "invalid_api_key"
    state.workers.shutdown(wait=False)
