"""One `tokenmill serve --task embed` (all-MiniLM-L6-v2, 512 tokens): a text longer than the
model can read is refused before it is tokenized, with a 400 naming the field and the limit,
on /v1/embeddings, Ollama's /api/embed and a vector-store search; an upload dropped midway
is one log line without a traceback. After each, the next normal request is answered."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tokenmill.api.chat import MAX_CHARS_PER_TOKEN

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from server_harness import Server, start_server  # noqa: E402

MAX_MODEL_LEN = 512  # the harness's --max-model-len
LIMIT = MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN
# Retrieval embeds with the model's 512 positions less [CLS] and [SEP].
QUERY_LIMIT = (MAX_MODEL_LEN - 2) * MAX_CHARS_PER_TOKEN
BIG = "The lighthouse keeper logs every passing ship. " * (LIMIT // 40)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server("--task", "embed", "--data-dir", str(tmp_path_factory.mktemp("data")))
    yield s
    assert s.stop() == 0, s.log()


def refused(r: httpx.Response, param: str, where: str, limit: int) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    message = err["message"] if isinstance(err, dict) else err
    assert f"{where} has {len(BIG)} characters" in message and str(limit) in message
    if isinstance(err, dict):
        assert err["param"] == param


def test_embeddings_input_over_the_limit(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": BIG}, timeout=60)
    refused(r, "input", "input", LIMIT)
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["hi", BIG]}, timeout=60)
    refused(r, "input", "input[1]", LIMIT)
    r = httpx.post(f"{server.url}/v1/embeddings",
                   json={"input": BIG, "truncate_prompt_tokens": -1}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello"}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


def test_ollama_embed_input_over_the_limit(server: Server) -> None:
    body = {"model": server.model, "input": BIG}
    r = httpx.post(f"{server.url}/api/embed", json=body, timeout=60)
    refused(r, "input", "input", LIMIT)
    r = httpx.post(f"{server.url}/api/embed", json={"model": server.model, "input": "hello"},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["embeddings"][0]) == 384


def test_search_query_over_the_limit(server: Server) -> None:
    f = httpx.post(f"{server.url}/v1/files", data={"purpose": "assistants"},
                   files={"file": ("k.txt", b"The lighthouse keeper logs every ship.")},
                   timeout=60).json()
    vs = httpx.post(f"{server.url}/v1/vector_stores", json={"file_ids": [f["id"]]},
                    timeout=60).json()["id"]
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/v1/vector_stores/{vs}").json()["file_counts"]["in_progress"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = httpx.post(f"{server.url}/v1/vector_stores/{vs}/search", json={"query": BIG},
                   timeout=60)
    refused(r, "query", "query", QUERY_LIMIT)
    r = httpx.post(f"{server.url}/v1/vector_stores/{vs}/search",
                   json={"query": "lighthouse"}, timeout=60)
    assert r.status_code == 200 and r.json()["data"][0]["file_id"] == f["id"]


def test_dropped_upload_is_one_line(server: Server) -> None:
    boundary = "b0undary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"n.txt\"\r\n\r\n").encode()
    request = (f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
               "Content-Length: 1000000\r\n"
               f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request + head + b"some text\n" * 1000)
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while "upload dropped" not in server.log():
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    time.sleep(0.5)
    log = server.log()
    assert log.count("upload dropped") == 1
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]
    r = httpx.post(f"{server.url}/v1/files", data={"purpose": "assistants"},
                   files={"file": ("after.txt", b"a normal file")}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/v1/files/{r.json()['id']}/content").content == \
        b"a normal file"
