"""A small stand-in for the Hugging Face hub on 127.0.0.1, for huggingface_hub through
HF_ENDPOINT: exactly the endpoints a download calls, with the headers it reads.

- ``GET /api/models/{repo}[/revision/{rev}]``: the model info (``sha``, ``siblings``);
- ``GET /api/models/{repo}/tree/{rev}``: the file listing;
- ``HEAD|GET /{repo}/resolve/{rev}/{file}``: the file, with ``X-Repo-Commit``, ``ETag`` /
  ``X-Linked-Etag`` (its sha256, so the blob's name in the cache) and ``Content-Length``;
  a ``Range: bytes=N-`` GET answers 206 with the rest (huggingface_hub resumes with it).

Errors as the real hub sends them: 404 with ``X-Error-Code: RepoNotFound``,
``RevisionNotFound`` or ``EntryNotFound``; a gated repo answers 401 with ``X-Error-Code:
GatedRepo`` unless the request carries the repo's token.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

# A file's content: bytes, or the path of a file on disk (the embedded GGUF: 94 MiB).
Content = bytes | str


@dataclass
class Repo:
    """A repo: revision names (branches, tags) to commits, each commit's files, and the token
    a gated repo wants."""

    commits: dict[str, dict[str, Content]]
    refs: dict[str, str] = field(default_factory=dict)
    gated_token: str | None = None

    def commit(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


def commit_id(seed: str) -> str:
    """A 40-hex commit id (huggingface_hub tells commits from branch names by this shape)."""
    return hashlib.sha1(seed.encode()).hexdigest()


def _size(content: Content) -> int:
    return os.path.getsize(content) if isinstance(content, str) else len(content)


def _read(content: Content, start: int) -> Iterator[bytes]:
    if isinstance(content, bytes):
        yield content[start:]
        return
    with open(content, "rb") as f:
        f.seek(start)
        while chunk := f.read(1 << 20):
            yield chunk


class StandInHub:
    """The hub's state and a log of the requests it answered."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        # File name -> bytes after which the next full GET of it drops the connection.
        self.drop_once: dict[str, int] = {}
        # Set: every request gets this status (the hub is down).
        self.fail_with: int | None = None
        self._etags: dict[tuple[str, str, str], str] = {}
        self._lock = threading.Lock()

    def etag(self, repo: str, commit: str, path: str) -> str:
        """The sha256 of a file (cached: the GGUF is hashed once)."""
        key = (repo, commit, path)
        with self._lock:
            if key not in self._etags:
                h = hashlib.sha256()
                for chunk in _read(self.repos[repo].commits[commit][path], 0):
                    h.update(chunk)
                self._etags[key] = h.hexdigest()
            return self._etags[key]


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+))?/?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: StandInHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet in tests
        pass

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append((self.command, path, self.headers.get("Range")))
        if self.hub.fail_with is not None:
            self._error(self.hub.fail_with, "", body, "the hub is down")
        elif m := _API.match(path):
            self._api(m["repo"], m["kind"], m["rev"] or "main", body)
        elif m := _RESOLVE.match(path):
            self._file(m["repo"], m["rev"], m["file"], body)
        else:
            self._error(404, "RepoNotFound", body)

    def _repo(self, name: str, revision: str, body: bool) -> tuple[Repo, str] | None:
        repo = self.hub.repos.get(name)
        if repo is None:
            self._error(404, "RepoNotFound", body)
            return None
        auth = self.headers.get("Authorization", "")
        if repo.gated_token is not None and auth != f"Bearer {repo.gated_token}":
            self._error(401, "GatedRepo", body, f"Access to model {name} is restricted. You "
                        "must have access to it and be authenticated to access it.")
            return None
        commit = repo.commit(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", body)
            return None
        return repo, commit

    def _api(self, name: str, kind: str | None, revision: str, body: bool) -> None:
        found = self._repo(name, revision, body)
        if found is None:
            return
        repo, commit = found
        files = repo.commits[commit]
        if kind == "tree":
            data: object = [{"type": "file", "path": p, "size": _size(c),
                             "oid": commit_id(f"{commit}/{p}")} for p, c in sorted(files.items())]
        else:
            data = {"id": name, "modelId": name, "sha": commit, "private": False,
                    "gated": "manual" if repo.gated_token else False, "disabled": False,
                    "siblings": [{"rfilename": p} for p in sorted(files)], "tags": []}
        payload = json.dumps(data).encode()
        self._send(200, {"Content-Type": "application/json"}, [payload] if body else [],
                   len(payload))

    def _file(self, name: str, revision: str, path: str, body: bool) -> None:
        found = self._repo(name, revision, body)
        if found is None:
            return
        repo, commit = found
        content = repo.commits[commit].get(path)
        if content is None:
            self._error(404, "EntryNotFound", body, commit=commit)
            return
        size, etag = _size(content), self.hub.etag(name, commit, path)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"',
                   "X-Linked-Size": str(size), "Accept-Ranges": "bytes"}
        start = 0
        if body and (m := re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))):
            start = int(m[1])
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        chunks = _read(content, start) if body else []
        cut = self.hub.drop_once.pop(path, None) if body and not start else None
        self._send(206 if start else 200, headers, chunks, size - start, cut)

    def _error(self, status: int, code: str, body: bool, message: str = "",
               commit: str | None = None) -> None:
        headers = {"Content-Type": "application/json"} | ({"X-Error-Code": code} if code else {})
        if message:
            headers["X-Error-Message"] = message
        if commit:
            headers["X-Repo-Commit"] = commit
        payload = json.dumps({"error": message or code}).encode()
        self._send(status, headers, [payload] if body else [], len(payload))

    def _send(self, status: int, headers: dict[str, str], chunks: Iterator[bytes] | list[bytes],
              length: int, cut: int | None = None) -> None:
        """Answer; ``cut``: close the connection after that many bytes of the body (a network
        failure in the middle of a download)."""
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        try:
            for chunk in chunks:
                if cut is not None and len(chunk) >= cut:
                    self.wfile.write(chunk[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if cut is not None:
                    cut -= len(chunk)
                self.wfile.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass


@contextmanager
def serve_hub(repos: dict[str, Repo]) -> Iterator[tuple[str, StandInHub]]:
    """Serve ``repos`` on a free port of 127.0.0.1; yields (endpoint URL, the hub)."""
    hub = StandInHub(repos)
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
