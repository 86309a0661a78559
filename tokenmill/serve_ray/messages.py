"""What travels between the ingress and a replica: an HTTP request as plain data, and the
response as a head (status, headers, the replica's name) followed by body chunks.

``run_asgi`` answers such a request with an ASGI application in the same process (the
replica's ``build_app``), so the replica's answer is byte for byte what ``tokenmill serve``
gives: the same routes, validation, middleware and error bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenmill.tokenizer import Tokenizer

# Headers the ingress's HTTP server sets itself on the way out.
HOP_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection"})
REPLICA_HEADER = "x-tokenmill-replica"
# The ingress's deployment (the replicas ask it for the file_search tool's results).
INGRESS_DEPLOYMENT = "tokenmill-ingress"


@dataclass(frozen=True)
class HTTPRequestData:
    """One HTTP request, whole (bodies are bounded by --max-body-bytes before they travel)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseHead:
    """The first message of a response: its status, headers and the replica that answers."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str


@dataclass(frozen=True)
class ModelInfo:
    """What the ingress needs of a deployment's model to route to it: the names it answers
    to (the model's, then its adapters'), its task, its tokenizer, and (text generation) its
    KV block size for the prompt's block hashes."""

    name: str
    task: str
    adapters: tuple[str, ...] = ()
    tokenizer: Tokenizer | None = None
    block_size: int = 0
    # Each adapter's prefix-cache salt (its blocks' hashes are chained to it).
    salts: dict[str, bytes] = field(default_factory=dict)
    # An embedding model's context (the ingress's retrieval splits its texts to fit).
    max_model_len: int = 0


def _scope(req: HTTPRequestData) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": req.method, "scheme": "http",
            "path": req.path, "raw_path": req.path.encode(), "root_path": "",
            "query_string": req.query_string, "headers": req.headers,
            "client": req.client, "server": ("127.0.0.1", 0)}


async def run_asgi(app: Any, req: HTTPRequestData, replica: str,
                   context: contextvars.Context | None = None
                   ) -> AsyncIterator[ResponseHead | bytes]:
    """The app's response to ``req``: a ResponseHead, then the body's chunks. Closing the
    iterator early (the client left) tells the app the client disconnected. ``context``:
    the context variables the app runs with (the project of a request the ingress admitted)."""
    sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    task = asyncio.get_running_loop().create_task(app(_scope(req), receive, send),
                                                  context=context)
    task.add_done_callback(lambda _: sent.put_nowait({"type": "tokenmill.done"}))
    try:
        while True:
            message = await sent.get()
            kind = message["type"]
            if kind == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() not in HOP_HEADERS]
                yield ResponseHead(message["status"], headers, replica)
            elif kind == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
            elif kind == "tokenmill.done":
                task.result()  # the app's exception, if it raised before answering
                break
    finally:
        gone.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task
