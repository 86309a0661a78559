"""What the ingress decides without a cluster under --replicas: each replica's KV-event
endpoints (kv_endpoints.py), the routes it refuses and the admin API it answers itself
(front.py), which paths its store answers (stores.py), and who may change LoRA adapters and what the log records (adapters.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.serve")

from tokenmill.api.errors import APIError  # noqa: E402
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig  # noqa: E402
from tokenmill.engine.args import LoRAModule  # noqa: E402
from tokenmill.serve_ray.adapters import (  # noqa: E402
    LOAD_PATH,
    UNLOAD_PATH,
    AdapterOp,
    AdapterRoutes,
)
from tokenmill.serve_ray.front import UNSUPPORTED, FrontDoor, unsupported  # noqa: E402
from tokenmill.serve_ray.kv_endpoints import (  # noqa: E402
    advertised,
    port_ranges,
    replica_endpoint,
)
from tokenmill.serve_ray.messages import HTTPRequestData  # noqa: E402


def test_each_replica_binds_the_port_of_its_rank() -> None:
    assert replica_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert replica_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert advertised("tcp://*:5559", "10.0.0.7") == "tcp://10.0.0.7:5559"
    assert advertised("tcp://127.0.0.1:5559", "10.0.0.7") == "tcp://127.0.0.1:5559"
    with pytest.raises(ValueError, match="kv_events_replay_endpoint: .* tcp://HOST:PORT"):
        replica_endpoint("ipc:///tmp/kv", 1, "kv_events_replay_endpoint")
    with pytest.raises(ValueError, match="above 65535"):
        replica_endpoint("tcp://*:65535", 1)


def _model(events: str | None, replay: str | None = None) -> EngineConfig:
    return EngineConfig(model=ModelConfig(), cache=CacheConfig(
        kv_events_endpoint=events, kv_events_replay_endpoint=replay))


def test_port_ranges_of_the_models_must_not_overlap() -> None:
    assert port_ranges([("a", _model("tcp://*:5557", "tcp://*:6557"))], 4) == [
        (5557, 5560, "kv_events_endpoint of a"), (6557, 6560, "kv_events_replay_endpoint of a")]
    # vLLM's usual pair: the second replica's events would take the first one's replay port.
    with pytest.raises(ValueError, match="overlaps the kv_events_endpoint of a"):
        port_ranges([("a", _model("tcp://*:5557", "tcp://*:5558"))], 2)
    with pytest.raises(ValueError, match="kv_events_endpoint of b .* overlaps"):
        port_ranges([("a", _model("tcp://*:5557")), ("b", _model("tcp://*:5559"))], 3)
    assert port_ranges([("a", _model("tcp://*:5557")), ("b", _model("tcp://*:5559"))], 2)
    assert port_ranges([("a", _model(None))], 8) == []


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/batches/batch_1/cancel"])
def test_batches_are_refused_by_name(path: str) -> None:
    err = unsupported(path)
    assert err is not None and err.status == 400 and err.code == UNSUPPORTED
    assert "--replicas" in err.message


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/batchesx", "/v1/files",
                                  "/v1/vector_stores/vs_1/search", "/v1/responses"])
def test_everything_else_is_served(path: str) -> None:
    assert unsupported(path) is None


def test_the_ingress_keeps_files_and_vector_stores() -> None:
    from tokenmill.serve_ray.stores import is_store_path

    assert is_store_path("/v1/files") and is_store_path("/v1/files/file-1/content")
    assert is_store_path("/v1/vector_stores/vs_1/search")
    assert not is_store_path("/v1/filesystem") and not is_store_path("/v1/batches")


def _req(path: str, body: dict, key: str | None = None) -> HTTPRequestData:
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return HTTPRequestData("POST", path, b"", headers, json.dumps(body).encode())


def test_only_the_admin_key_changes_adapters_and_the_replica_sees_the_server_key() -> None:
    routes = AdapterRoutes("adm", "srv", None)
    body = {"lora_name": "sql", "lora_path": "/a/sql"}
    for key in (None, "srv", "wrong"):
        refused = routes.authorize(_req(LOAD_PATH, body, key))
        assert isinstance(refused, APIError) and refused.status == 401
    passed = routes.authorize(_req(LOAD_PATH, body, "adm"))
    assert isinstance(passed, HTTPRequestData)
    assert (b"authorization", b"Bearer srv") in passed.headers
    assert not any(v == b"Bearer adm" for _, v in passed.headers)
    # Without an admin key the request goes as it is (the replica checks the API key).
    plain = _req(LOAD_PATH, body, "srv")
    assert AdapterRoutes(None, "srv", None).authorize(plain) is plain


def test_the_log_records_the_checked_path_and_the_base(tmp_path) -> None:
    (tmp_path / "sql").mkdir()
    routes = AdapterRoutes(None, None, str(tmp_path))
    load = _req(LOAD_PATH, {"lora_name": "sql", "lora_path": "sql", "base_model_name": "b"})
    assert routes.model_named(load) == "b"
    assert routes.operation(load) == AdapterOp("sql", LoRAModule(
        "sql", str((tmp_path / "sql").resolve()), "b"))
    unload = _req(UNLOAD_PATH, {"lora_name": "sql"})
    assert routes.model_named(unload) == "sql" and routes.operation(unload) == AdapterOp("sql")
    at = routes.position("tokenmill-replica")
    assert at.length == 0 and at.log.startswith("tokenmill-adapter-log-")
    # Another ingress (a restarted one) keeps another log.
    assert AdapterRoutes(None, None, None).position("tokenmill-replica").log != at.log


def test_a_replica_follows_the_log_of_the_ingress_it_hears_from() -> None:
    from tokenmill.serve_ray.adapters import AdapterSync, LogPosition

    sync = AdapterSync(None, "d")  # type: ignore[arg-type]
    assert not sync.behind(LogPosition())
    sync.log, sync.applied = "log-a", 2
    assert not sync.behind(LogPosition("log-a", 2)) and sync.behind(LogPosition("log-a", 3))
    # A restarted ingress's log, even empty, is followed from its start.
    assert sync.behind(LogPosition("log-b", 0))


def test_the_ingress_answers_the_admin_api_over_the_one_store(tmp_path) -> None:
    """Projects and keys made through the ingress's admin app are in the store its
    admission reads; /admin/models is refused by name; a bad key is a 401."""
    from fastapi.testclient import TestClient

    front = FrontDoor(ServerConfig(admin_key="adm", data_dir=str(tmp_path)))
    admin = {"Authorization": "Bearer adm"}
    with TestClient(front.app) as client:
        project = client.post("/v1/organization/projects", headers=admin,
                              json={"name": "team", "max_requests_per_1_minute": 1}).json()
        key = client.post(f"/v1/organization/projects/{project['id']}/api_keys",
                          headers=admin, json={"name": "k"}).json()["value"]
        refused = client.post("/admin/models", headers=admin, json={"name": "x", "path": "y"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == UNSUPPORTED
        assert client.get("/admin/models").status_code == 401
        assert client.get("/v1/organization/projects").status_code == 401
    caller, headers = front.admit(key)
    assert caller.project.id == project["id"] and headers["x-ratelimit-limit-requests"] == "1"
    over = front.admit(key)
    assert isinstance(over, APIError) and over.status == 429
    front.release(caller)
    bad = front.admit("sk-proj-nope")
    assert isinstance(bad, APIError) and bad.status == 401
