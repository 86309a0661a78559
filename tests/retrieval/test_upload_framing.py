"""Uploads that end badly: a client that goes away mid-upload costs one short log line (no
traceback) and leaves nothing on disk; a multipart body without its closing boundary is a
400, not a stored (truncated) file. The next normal upload works in both cases."""

from __future__ import annotations

import io
import logging
import os
import socket
import time

import httpx
import openai
import pytest
from retrieval_harness import RetrievalServer

BOUNDARY = "b0undary"
HEAD = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
        f"assistants\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
        f"filename=\"notes.txt\"\r\n\r\n").encode()
TEXT = b"The lighthouse keeper logs every passing ship.\n" * 50


def files_on_disk(data_dir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(data_dir, "files")))


def normal_upload_works(server: RetrievalServer, data_dir: str) -> None:
    client = server.client()
    before = len(client.files.list().data)
    f = client.files.create(file=("after.txt", io.BytesIO(b"a normal file")),
                            purpose="assistants")
    assert client.files.content(f.id).read() == b"a normal file"
    assert len(client.files.list().data) == before + 1
    assert f.id in files_on_disk(data_dir)


def test_upload_dropped_mid_body_logs_one_line(server: RetrievalServer, data_dir: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    declared = len(HEAD) + 10 * len(TEXT)
    request = (f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {declared}\r\n"
               f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n").encode()
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request + HEAD + TEXT)
            time.sleep(0.5)  # the server is now reading the file part
        # The server notices the disconnect on its next read; wait for its line.
        deadline = time.monotonic() + 30
        while not any("disconnected" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
        time.sleep(0.3)  # anything it would log after that line
    dropped = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelno <= logging.INFO
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in caplog.records]
    assert not [n for n in files_on_disk(data_dir) if n.startswith(".upload-")]
    assert server.client().files.list().data == []
    normal_upload_works(server, data_dir)


@pytest.mark.parametrize("tail", [b"", b"\r\n", f"\r\n--{BOUNDARY}".encode(),
                                  f"\r\n--{BOUNDARY}\r\n".encode()])
def test_body_without_closing_boundary_is_refused(server: RetrievalServer, data_dir: str,
                                                  tail: bytes) -> None:
    r = httpx.post(f"{server.url}/v1/files", content=HEAD + TEXT + tail, timeout=30,
                   headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "closing boundary" in err["message"] and err["param"] == "file"
    assert files_on_disk(data_dir) == []
    assert server.client().files.list().data == []
    normal_upload_works(server, data_dir)


def test_complete_body_is_stored_whole(server: RetrievalServer, data_dir: str) -> None:
    """The same bytes with the closing boundary: one file, exactly its bytes."""
    r = httpx.post(f"{server.url}/v1/files",
                   content=HEAD + TEXT + f"\r\n--{BOUNDARY}--\r\n".encode(), timeout=30,
                   headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert r.status_code == 200, r.text
    client = server.client()
    assert client.files.content(r.json()["id"]).read() == TEXT
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-missing")
