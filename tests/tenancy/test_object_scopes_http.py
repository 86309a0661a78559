"""Who sees which object, on every object route: a project key its project's only; the
server key (``--api-key``) every object; what the server key (or, on a server without
``--api-key``, a request without a key) creates belongs to no project (OpenAI's "Default
project") and is a 404 to every project key. Lists of a project are paged over its own
objects, not narrowed after paging."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tenancy_harness import (
    ADMIN_KEY,
    SERVER_KEY,
    Server,
    new_key,
    new_project,
    start,
    start_server,
)


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def upload(c: openai.OpenAI, text: bytes) -> str:
    return c.files.create(file=("f.txt", io.BytesIO(text)), purpose="assistants").id


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start(Path(tmp_path_factory.mktemp("data")))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def made(server: Server) -> dict[str, Any]:
    """A file, vector store and stored response made with the server key, and a project."""
    srv = client(server, SERVER_KEY)
    f = upload(srv, b"The server's word is kestrel.")
    vs = srv.vector_stores.create(name="server's", file_ids=[f])
    resp = srv.responses.create(model=server.model, input="hi", max_output_tokens=3,
                                store=True)
    p = client(server, new_key(server, new_project(server))["value"])
    return {"model": server.model, "srv": srv, "p": p, "file": f, "vs": vs.id,
            "resp": resp.id}


SERVER_OBJECT_CALLS = {
    "files.retrieve": lambda p, o: p.files.retrieve(o["file"]),
    "files.content": lambda p, o: p.files.content(o["file"]),
    "files.delete": lambda p, o: p.files.delete(o["file"]),
    "vector_stores.retrieve": lambda p, o: p.vector_stores.retrieve(o["vs"]),
    "vector_stores.update": lambda p, o: p.vector_stores.update(o["vs"], name="mine"),
    "vector_stores.search": lambda p, o: p.vector_stores.search(o["vs"], query="word"),
    "vector_stores.files.list": lambda p, o: p.vector_stores.files.list(o["vs"]),
    "vector_stores.delete": lambda p, o: p.vector_stores.delete(o["vs"]),
    "vector_stores.create(file_ids)": lambda p, o: p.vector_stores.create(
        file_ids=[o["file"]]),
    "responses.retrieve": lambda p, o: p.responses.retrieve(o["resp"]),
    "responses.delete": lambda p, o: p.responses.delete(o["resp"]),
    "responses.create(previous_response_id)": lambda p, o: p.responses.create(
        model=o["model"], input="and?", previous_response_id=o["resp"]),
    "responses.create(file_search)": lambda p, o: p.responses.create(
        model=o["model"], input="word?", tools=[{"type": "file_search",
                                                 "vector_store_ids": [o["vs"]]}]),
}


@pytest.mark.parametrize("name", list(SERVER_OBJECT_CALLS))
def test_the_server_keys_objects_are_404_to_a_project(made: dict, name: str) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        SERVER_OBJECT_CALLS[name](made["p"], made)
    assert "kestrel" not in str(e.value.body)
    # Nothing changed: the server key still reads them.
    assert made["srv"].files.content(made["file"]).read() == b"The server's word is kestrel."
    assert made["srv"].vector_stores.retrieve(made["vs"]).name == "server's"
    assert made["srv"].responses.retrieve(made["resp"]).id == made["resp"]


def test_the_server_key_uses_a_projects_objects(made: dict) -> None:
    p, srv = made["p"], made["srv"]
    f = upload(p, b"The project's word is plover.")
    vs = p.vector_stores.create(name="project's", file_ids=[f])
    resp = p.responses.create(model=made["model"], input="hi", max_output_tokens=3, store=True)
    assert srv.files.content(f).read() == b"The project's word is plover."
    assert srv.vector_stores.retrieve(vs.id).name == "project's"
    assert srv.responses.retrieve(resp.id).id == resp.id
    # ... and may name them in its own requests.
    assert srv.vector_stores.create(name="both", file_ids=[f, made["file"]]).file_counts
    follow = srv.responses.create(model=made["model"], input="and?", max_output_tokens=3,
                                  previous_response_id=resp.id)
    assert follow.previous_response_id == resp.id


def test_the_admin_key_is_for_the_admin_routes_only(server: Server, made: dict) -> None:
    # As OpenAI's admin keys: no objects, no inference, with it.
    r = httpx.get(f"{server.url}/v1/files/{made['file']}", timeout=30,
                  headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 401


def test_a_projects_list_pages_over_its_own_objects(server: Server) -> None:
    p = client(server, new_key(server, new_project(server))["value"])
    srv = client(server, SERVER_KEY)
    mine = [upload(p, b"one")]
    other = [upload(srv, b"server's"), upload(srv, b"server's too")]
    mine.append(upload(p, b"two"))
    other.append(upload(srv, b"server's three"))
    first = p.files.list(limit=1, order="asc")
    assert [f.id for f in first.data] == [mine[0]] and first.has_more
    second = p.files.list(limit=1, order="asc", after=mine[0])
    assert [f.id for f in second.data] == [mine[1]] and not second.has_more
    newest = p.files.list(limit=1)  # newest first: three of the server's files are newer
    assert [f.id for f in newest.data] == [mine[1]] and newest.has_more
    assert [f.id for f in p.files.list(limit=10)] == mine[::-1]
    # Another's id is no cursor of this list (the same 400 as an unknown id).
    with pytest.raises(openai.BadRequestError):
        p.files.list(after=other[0])
    stores = [p.vector_stores.create(name="a").id, srv.vector_stores.create(name="b").id]
    listed = p.vector_stores.list(limit=1)
    assert [v.id for v in listed.data] == [stores[0]] and not listed.has_more
    # The server key's own list is untouched.
    assert [f.id for f in srv.files.list(limit=2).data] == [other[2], mine[1]]


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with projects but no --api-key: requests without a key are answered."""
    s = start_server("--admin-key", ADMIN_KEY, "--data-dir",
                     str(tmp_path_factory.mktemp("open")))
    yield s
    s.stop()


def test_without_a_server_key_a_keyless_request_sees_no_projects_objects(
        open_server: Server) -> None:
    p = client(open_server, new_key(open_server, new_project(open_server))["value"])
    anyone = client(open_server, "no-key")
    secret = upload(p, b"The project's word is avocet.")
    vs = p.vector_stores.create(name="project's", file_ids=[secret])
    for call in (lambda: anyone.files.retrieve(secret),
                 lambda: anyone.files.content(secret),
                 lambda: anyone.vector_stores.retrieve(vs.id),
                 lambda: anyone.vector_stores.create(file_ids=[secret])):
        with pytest.raises(openai.NotFoundError):
            call()
    assert secret not in [f.id for f in anyone.files.list()]
    assert vs.id not in [v.id for v in anyone.vector_stores.list()]
    # What a keyless request makes is the default project's: its own, no project's.
    public = upload(anyone, b"public")
    assert anyone.files.retrieve(public).id == public
    assert [f.id for f in anyone.files.list()] == [public]
    with pytest.raises(openai.NotFoundError):
        p.files.retrieve(public)
    assert p.files.content(secret).read() == b"The project's word is avocet."
