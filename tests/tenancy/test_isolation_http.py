"""Each project's files, vector stores (with their files and file batches) and stored
responses are its own: another project's key gets 404 on every route that names them, and
lists show only its own; the server key sees everything; Ollama's routes take project keys."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tenancy_harness import SERVER_KEY, Server, new_key, new_project, start


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start(Path(tmp_path_factory.mktemp("data")))
    yield s
    s.stop()


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def owned(server: Server) -> dict[str, Any]:
    """Project a's file, vector store (holding the file), file batch and stored response."""
    a = client(server, new_key(server, new_project(server))["value"])
    b = client(server, new_key(server, new_project(server))["value"])
    f = a.files.create(file=("notes.txt", io.BytesIO(b"The secret word is heron.")),
                       purpose="assistants")
    vs = a.vector_stores.create(name="a's", file_ids=[f.id])
    f2 = a.files.create(file=("more.txt", io.BytesIO(b"More text.")), purpose="assistants")
    batch = a.vector_stores.file_batches.create(vector_store_id=vs.id, file_ids=[f2.id])
    resp = a.responses.create(model=server.model, input="hi", max_output_tokens=3, store=True)
    return {"model": server.model, "a": a, "b": b, "file": f.id, "vs": vs.id, "batch": batch.id, "resp": resp.id}


def test_the_owner_sees_its_objects(owned: dict) -> None:
    a = owned["a"]
    assert a.files.retrieve(owned["file"]).id == owned["file"]
    assert a.files.content(owned["file"]).read() == b"The secret word is heron."
    assert a.vector_stores.retrieve(owned["vs"]).id == owned["vs"]
    assert a.responses.retrieve(owned["resp"]).id == owned["resp"]
    assert owned["file"] in [f.id for f in a.files.list()]


CALLS = {
    "files.retrieve": lambda b, o: b.files.retrieve(o["file"]),
    "files.content": lambda b, o: b.files.content(o["file"]),
    "files.delete": lambda b, o: b.files.delete(o["file"]),
    "vector_stores.retrieve": lambda b, o: b.vector_stores.retrieve(o["vs"]),
    "vector_stores.update": lambda b, o: b.vector_stores.update(o["vs"], name="mine"),
    "vector_stores.search": lambda b, o: b.vector_stores.search(o["vs"], query="secret"),
    "vector_stores.files.list": lambda b, o: b.vector_stores.files.list(o["vs"]),
    "vector_stores.files.retrieve": lambda b, o: b.vector_stores.files.retrieve(
        o["file"], vector_store_id=o["vs"]),
    "vector_stores.delete": lambda b, o: b.vector_stores.delete(o["vs"]),
    "file_batches.retrieve": lambda b, o: b.vector_stores.file_batches.retrieve(
        o["batch"], vector_store_id=o["vs"]),
    "vector_stores.create(file_ids)": lambda b, o: b.vector_stores.create(
        file_ids=[o["file"]]),
    "responses.retrieve": lambda b, o: b.responses.retrieve(o["resp"]),
    "responses.delete": lambda b, o: b.responses.delete(o["resp"]),
    "responses.create(previous_response_id)": lambda b, o: b.responses.create(
        model=o["model"], input="and?", previous_response_id=o["resp"]),
    "responses.create(file_search)": lambda b, o: b.responses.create(
        model=o["model"], input="secret?", tools=[{"type": "file_search",
                                            "vector_store_ids": [o["vs"]]}]),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_another_project_gets_404(owned: dict, name: str) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        CALLS[name](owned["b"], owned)
    assert "heron" not in str(e.value.body)
    # Nothing was changed or deleted: the owner still has it.
    assert owned["a"].vector_stores.retrieve(owned["vs"]).name == "a's"
    assert owned["a"].files.content(owned["file"]).read() == b"The secret word is heron."


def test_lists_show_only_the_projects_own(owned: dict) -> None:
    assert owned["file"] not in [f.id for f in owned["b"].files.list()]
    assert owned["vs"] not in [v.id for v in owned["b"].vector_stores.list()]
    mine = owned["b"].files.create(file=("b.txt", io.BytesIO(b"b's")), purpose="assistants")
    assert [f.id for f in owned["b"].files.list()] == [mine.id]


def test_the_server_key_sees_everything(server: Server, owned: dict) -> None:
    admin_client = client(server, SERVER_KEY)
    assert admin_client.files.retrieve(owned["file"]).id == owned["file"]
    assert owned["vs"] in [v.id for v in admin_client.vector_stores.list()]


def test_ollama_routes_take_project_keys(server: Server) -> None:
    key = new_key(server, new_project(server))["value"]
    body = {"model": server.model, "prompt": "hi", "stream": False,
            "options": {"num_predict": 2}}
    r = httpx.post(f"{server.url}/api/generate", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/api/generate", json=body, timeout=60,
                   headers={"Authorization": "Bearer sk-proj-unknown"})
    assert r.status_code == 401 and "error" in r.json()


def test_a_streamed_stored_response_is_its_projects(owned: dict) -> None:
    events = list(owned["a"].responses.create(model=owned["model"], input="hi", stream=True,
                                              max_output_tokens=3, store=True))
    rid = events[0].response.id
    assert owned["a"].responses.retrieve(rid).id == rid
    with pytest.raises(openai.NotFoundError):
        owned["b"].responses.retrieve(rid)
