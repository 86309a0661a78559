"""Projects and keys over the admin API (OpenAI's shapes), keys used through the openai client:
shown once, stored as hashes, revoked at once, kept across a restart; the server key still
works; bad ids and limits are refused."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tenancy_harness import ADMIN, SERVER_KEY, Server, admin, new_key, new_project, start


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[Server]:
    s = start(data_dir)
    yield s
    s.stop()


def chat(server: Server, key: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    return client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0)


def test_admin_routes_need_the_admin_key(server: Server) -> None:
    url = f"{server.url}/v1/organization/projects"
    assert httpx.get(url).status_code == 401
    server_key = {"Authorization": f"Bearer {SERVER_KEY}"}
    assert httpx.get(url, headers=server_key).status_code == 401
    assert httpx.get(url, headers=ADMIN).status_code == 200


def test_project_lifecycle_in_openai_shapes(server: Server) -> None:
    pid = new_project(server, priority=2, max_requests_per_1_minute=100)
    got = admin(server, "GET", f"/projects/{pid}").json()
    assert got["object"] == "organization.project" and got["status"] == "active"
    assert got["archived_at"] is None and got["priority"] == 2
    assert got["max_requests_per_1_minute"] == 100
    listed = admin(server, "GET", "/projects").json()
    assert listed["object"] == "list" and pid in [p["id"] for p in listed["data"]]
    changed = admin(server, "POST", f"/projects/{pid}", json={"name": "renamed"}).json()
    assert changed["name"] == "renamed" and changed["max_requests_per_1_minute"] == 100
    archived = admin(server, "POST", f"/projects/{pid}/archive").json()
    assert archived["status"] == "archived" and archived["archived_at"] is not None
    assert pid not in [p["id"] for p in admin(server, "GET", "/projects").json()["data"]]
    assert admin(server, "POST", f"/projects/{pid}/api_keys", json={}).status_code == 400


def test_key_is_shown_once_and_opens_inference(server: Server, data_dir: Path) -> None:
    pid = new_project(server)
    made = new_key(server, pid)
    value = made["value"]
    assert made["object"] == "organization.project.api_key" and value.startswith("sk-proj-")
    listed = admin(server, "GET", f"/projects/{pid}/api_keys").json()["data"]
    assert [k["id"] for k in listed] == [made["id"]]
    assert "value" not in listed[0] and value not in listed[0]["redacted_value"]
    assert chat(server, value).choices[0].message.content is not None
    # Only the hash is on disk.
    stored = b"".join(p.read_bytes() for p in data_dir.glob("tenancy.sqlite*"))
    assert value.encode() not in stored
    assert hashlib.sha256(value.encode()).hexdigest().encode() in stored


def test_server_key_keeps_working(server: Server) -> None:
    assert chat(server, SERVER_KEY).choices


def test_revoked_and_unknown_keys_get_the_same_401(server: Server) -> None:
    pid = new_project(server)
    made = new_key(server, pid)
    chat(server, made["value"])
    r = admin(server, "DELETE", f"/projects/{pid}/api_keys/{made['id']}")
    assert r.json() == {"object": "organization.project.api_key.deleted", "id": made["id"],
                        "deleted": True}
    with pytest.raises(openai.AuthenticationError) as revoked:
        chat(server, made["value"])
    with pytest.raises(openai.AuthenticationError) as unknown:
        chat(server, "sk-proj-" + "x" * 43)
    assert revoked.value.message == unknown.value.message
    # The next normal request is answered as before.
    assert chat(server, new_key(server, pid)["value"]).choices


def test_archiving_a_project_stops_its_keys(server: Server) -> None:
    pid = new_project(server)
    value = new_key(server, pid)["value"]
    chat(server, value)
    admin(server, "POST", f"/projects/{pid}/archive")
    with pytest.raises(openai.AuthenticationError):
        chat(server, value)


@pytest.mark.parametrize("body", [
    {"max_requests_per_1_minute": -1}, {"max_tokens_per_1_minute": 0},
    {"max_concurrent_requests": 10**9}, {"monthly_budget": -0.5}, {"monthly_budget": 1e30},
    {"priority": 1000}, {"name": ""}, {"color": "red"}])
def test_bad_project_bodies_are_400(server: Server, body: dict) -> None:
    r = admin(server, "POST", "/projects", json={"name": "x", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_unknown_ids_are_404(server: Server) -> None:
    pid = new_project(server)
    other = new_key(server, new_project(server))
    assert admin(server, "GET", "/projects/proj_nope").status_code == 404
    assert admin(server, "GET", f"/projects/{pid}/api_keys/{other['id']}").status_code == 404
    assert admin(server, "DELETE",
                 f"/projects/{pid}/api_keys/{other['id']}").status_code == 404
    # The other project's key still works: a wrong project id revoked nothing.
    assert chat(server, other["value"]).choices


def test_keys_and_projects_survive_a_restart(data_dir: Path, server: Server) -> None:
    pid = new_project(server)
    value = new_key(server, pid)["value"]
    second = start(data_dir)
    try:
        assert chat(second, value).choices
        assert admin(second, "GET", f"/projects/{pid}").status_code == 200
    finally:
        second.stop()
