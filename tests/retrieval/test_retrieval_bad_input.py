"""Bad input to the Files and Vector Stores routes: a clear 4xx with OpenAI's error body naming
the field, and nothing lost or left behind (no stray upload on disk, the store unchanged)."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator

import httpx
import openai
import pytest
from retrieval_harness import RetrievalServer, wait_done

from tokenmill.server.retrieval_routes import RetrievalLimits

LIMIT = 4096


@pytest.fixture
def server(data_dir: str) -> Iterator[RetrievalServer]:
    s = RetrievalServer(data_dir, limits=RetrievalLimits(max_upload_bytes=LIMIT)).start()
    yield s
    s.stop()


def upload(client: openai.OpenAI, name: str, data: bytes, purpose: str = "assistants") -> str:
    return client.files.create(file=(name, io.BytesIO(data)), purpose=purpose).id  # type: ignore[arg-type]


def error(exc: pytest.ExceptionInfo) -> dict:
    body = exc.value.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def stored_files(data_dir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(data_dir, "files")))


@pytest.fixture
def store(client: openai.OpenAI) -> tuple[str, str]:
    """A store holding one searchable file: what every bad request must leave as it was."""
    file_id = upload(client, "kept.txt", b"The lighthouse keeper logs every passing ship.")
    vs = client.vector_stores.create(name="kept", file_ids=[file_id]).id
    wait_done(client, vs)
    return vs, file_id


def intact(client: openai.OpenAI, store: tuple[str, str]) -> None:
    vs, file_id = store
    counts = client.vector_stores.retrieve(vs).file_counts
    assert counts.completed == 1 and counts.total == 1
    hit = client.vector_stores.search(vs, query="lighthouse keeper").data[0]
    assert hit.file_id == file_id and "lighthouse" in hit.content[0].text


@pytest.mark.parametrize("name,data,words", [
    ("report.pdf", b"%PDF-1.7 ...", "unsupported file type"),
    ("empty.txt", b"", "empty"),
    ("blank.md", b"  \n\t\n", "empty"),
    ("image.txt", b"\x89PNG\r\n\x1a\n\x00\x00", "binary"),
    ("latin1.txt", "caf\u00e9".encode("latin-1"), "not UTF-8"),
])
def test_unreadable_uploads(client: openai.OpenAI, data_dir: str, store: tuple[str, str],
                            name: str, data: bytes, words: str) -> None:
    before = stored_files(data_dir)
    with pytest.raises(openai.BadRequestError) as exc:
        upload(client, name, data)
    err = error(exc)
    assert words in err["message"] and err["param"] == "file"
    assert stored_files(data_dir) == before
    intact(client, store)


def test_empty_file_refused_for_any_purpose(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        upload(client, "x.jsonl", b"", purpose="batch")
    assert "empty" in error(exc)["message"]


def test_unknown_purpose(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        upload(client, "a.txt", b"hello", purpose="nonsense")
    assert error(exc)["param"] == "purpose"


def test_upload_over_limit_declared(client: openai.OpenAI, data_dir: str,
                                    store: tuple[str, str]) -> None:
    before = stored_files(data_dir)
    with pytest.raises(openai.APIStatusError) as exc:
        upload(client, "big.txt", b"x" * (LIMIT + 300 << 10))
    assert exc.value.status_code == 413 and error(exc)["code"] == "file_too_large"
    assert stored_files(data_dir) == before
    intact(client, store)


def test_upload_over_limit_while_streaming(server: RetrievalServer, data_dir: str) -> None:
    """No Content-Length (chunked): the limit is checked as the bytes arrive."""
    boundary = "b0undary"

    def body() -> Iterator[bytes]:
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
               f"assistants\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
               f"filename=\"big.txt\"\r\n\r\n").encode()
        for _ in range(4):
            yield b"y" * LIMIT
        yield f"\r\n--{boundary}--\r\n".encode()

    before = stored_files(data_dir)
    r = httpx.post(f"{server.url}/v1/files", content=body(), timeout=30,
                   headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "file"
    assert stored_files(data_dir) == before


def test_upload_without_multipart_or_file(server: RetrievalServer) -> None:
    r = httpx.post(f"{server.url}/v1/files", json={"purpose": "assistants"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(f"{server.url}/v1/files", data={"purpose": "assistants"},
                   files={"other": ("a.txt", b"hi")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_unknown_ids(client: openai.OpenAI, store: tuple[str, str]) -> None:
    vs, file_id = store
    calls = [
        lambda: client.files.retrieve("file-nope"),
        lambda: client.files.delete("file-nope"),
        lambda: client.files.content("file-nope"),
        lambda: client.vector_stores.retrieve("vs_nope"),
        lambda: client.vector_stores.delete("vs_nope"),
        lambda: client.vector_stores.search("vs_nope", query="x"),
        lambda: client.vector_stores.files.create(vector_store_id="vs_nope", file_id=file_id),
        lambda: client.vector_stores.files.create(vector_store_id=vs, file_id="file-nope"),
        lambda: client.vector_stores.files.retrieve(file_id="file-nope", vector_store_id=vs),
        lambda: client.vector_stores.files.delete(file_id="file-nope", vector_store_id=vs),
        lambda: client.vector_stores.create(name="x", file_ids=[file_id, "file-nope"]),
        lambda: client.vector_stores.file_batches.retrieve("vsfb_nope", vector_store_id=vs),
        lambda: client.vector_stores.file_batches.create(vector_store_id=vs,
                                                         file_ids=[file_id, "file-nope"]),
    ]
    names_before = [s.id for s in client.vector_stores.list()]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as exc:
            call()
        assert "No " in error(exc)["message"]
    # The store create with a bad file id created nothing.
    assert [s.id for s in client.vector_stores.list()] == names_before
    intact(client, store)


@pytest.mark.parametrize("body,param", [
    ({"query": ""}, "query"),
    ({"query": "   "}, "query"),
    ({"query": []}, "query"),
    ({"query": ["ok", ""]}, "query"),
    ({}, "query"),
    ({"query": "x", "max_num_results": 0}, "max_num_results"),
    ({"query": "x", "max_num_results": 51}, "max_num_results"),
    ({"query": "x", "filters": {"key": "a", "type": "like", "value": 1}}, "filters"),
    ({"query": "x", "filters": {"key": "a", "type": "in", "value": 1}}, "filters"),
    ({"query": "x", "filters": {"key": "a", "type": "eq", "value": [1]}}, "filters"),
    ({"query": "x", "filters": {"key": "a", "type": "gt", "value": True}}, "filters"),
    ({"query": "x", "filters": {"type": "and", "filters": []}}, "filters"),
    ({"query": "x", "filters": {"type": "and"}}, "filters"),
    ({"query": "x", "ranking_options": {"score_threshold": 1.5}}, "ranking_options"),
])
def test_bad_search(server: RetrievalServer, store: tuple[str, str], body: dict,
                    param: str) -> None:
    r = httpx.post(f"{server.url}/v1/vector_stores/{store[0]}/search", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("static,words", [
    ({"max_chunk_size_tokens": 99, "chunk_overlap_tokens": 0}, "greater than or equal to 100"),
    ({"max_chunk_size_tokens": 5000, "chunk_overlap_tokens": 0}, "less than or equal to 4096"),
    ({"max_chunk_size_tokens": 200, "chunk_overlap_tokens": 101}, "half"),
    ({"max_chunk_size_tokens": 200, "chunk_overlap_tokens": -1}, "greater than or equal to 0"),
    # The test embedder reads 400 tokens at once.
    ({"max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400}, "reads at once"),
])
def test_bad_chunking(client: openai.OpenAI, store: tuple[str, str], static: dict,
                      words: str) -> None:
    vs, file_id = store
    other = upload(client, "other.txt", b"another document")
    with pytest.raises(openai.BadRequestError) as exc:
        client.vector_stores.files.create(vector_store_id=vs, file_id=other,
                                          chunking_strategy={"type": "static", "static": static})
    err = error(exc)
    assert words in err["message"] and err["param"] == "chunking_strategy"
    intact(client, store)


def test_attach_unreadable_file(client: openai.OpenAI, store: tuple[str, str]) -> None:
    vs, _ = store
    # Stored as user_data (any bytes), then attached: the type is refused at once...
    pdf = upload(client, "scan.pdf", b"%PDF-1.7", purpose="user_data")
    with pytest.raises(openai.BadRequestError) as exc:
        client.vector_stores.files.create(vector_store_id=vs, file_id=pdf)
    assert "unsupported file type" in error(exc)["message"]
    # ...and content that is not text fails the file, with the reason.
    binary = upload(client, "dump.txt", b"\xff\xfe\x00garbage", purpose="user_data")
    vf = client.vector_stores.files.create_and_poll(vector_store_id=vs, file_id=binary)
    assert vf.status == "failed" and vf.last_error.code == "invalid_file"
    assert "binary" in vf.last_error.message
    counts = client.vector_stores.retrieve(vs).file_counts
    assert counts.failed == 1 and counts.completed == 1
    hit = client.vector_stores.search(vs, query="lighthouse keeper").data[0]
    assert hit.filename == "kept.txt"


def test_bad_bodies_and_lists(server: RetrievalServer, store: tuple[str, str]) -> None:
    vs, _ = store
    url = f"{server.url}/v1/vector_stores"
    cases = [
        (httpx.post(url, content=b"{", headers={"content-type": "application/json"}), None),
        (httpx.post(url, json={"name": 3}), "name"),
        (httpx.post(url, json={"metadata": {f"k{i}": "v" for i in range(17)}}), "metadata"),
        (httpx.post(url, json={"expires_after": {"anchor": "created_at", "days": 1}}),
         "expires_after"),
        (httpx.post(f"{url}/{vs}/files", json={"file_id": "f", "attributes": {"a": [1]}}),
         "attributes"),
        (httpx.get(f"{url}?limit=0"), "limit"),
        (httpx.get(f"{url}?limit=101"), "limit"),
        (httpx.get(f"{url}?order=sideways"), "order"),
        (httpx.get(f"{url}?after=vs_unknown"), "after"),
        (httpx.get(f"{url}/{vs}/files?filter=done"), "filter"),
        (httpx.post(f"{url}/{vs}/file_batches", json={"file_ids": []}), None),
    ]
    for r, param in cases:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(url, content=b'{"name": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415
