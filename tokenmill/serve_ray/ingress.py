"""The ingress: Ray Serve's HTTP entry point, forwarding each request whole to a replica of
the model it names (one deployment per served model, catalog.py) that answers it with
``tokenmill serve``'s application, and streaming the answer back with the replica's name in
``x-tokenmill-replica``. The routes that list every model get every deployment's list merged;
/health is ok when every deployment is.

The ingress answers some routes itself: the admin API and project keys' admission (front.py),
files and vector stores (stores.py), and LoRA adapter loads, sent to one replica and logged for
the others (adapters.py).

The ingress computes the prompt's block hashes (``route_key``) with the model's tokenizer, for
the prefix-aware router of the model's deployment. A replica that dies before it sends the head of its answer (the
request had not started there) is left for another: the request is sent again, up to
``MAX_ATTEMPTS`` times. An answer already streaming when its replica dies ends with an error
event (server-sent events) instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from prometheus_client import CONTENT_TYPE_LATEST
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenmill.api.errors import APIError
from tokenmill.config import ServerConfig
from tokenmill.serve_ray.adapters import LOAD_PATH, UNLOAD_PATH, AdapterRoutes
from tokenmill.serve_ray.catalog import LISTING_ROUTES, Catalog, Entry, merge_listings
from tokenmill.serve_ray.front import FrontDoor, is_admin_path, unsupported
from tokenmill.serve_ray.messages import REPLICA_HEADER, HTTPRequestData, ResponseHead, run_asgi
from tokenmill.serve_ray.metrics import aggregate, open_board
from tokenmill.serve_ray.routing import ROUTE_KEY, block_hashes
from tokenmill.serve_ray.stores import IngressStores, is_store_path
from tokenmill.server.errors import error_response
from tokenmill.server.state import EMBED
from tokenmill.server.tenancy_guard import project_token
from tokenmill.tenancy.retention import TenancySettings
from tokenmill.tenancy.store import Caller
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Tries of a request whose replica died before answering (then a 503).
MAX_ATTEMPTS = 3
# Seconds between those tries: Ray notices the dead replica meanwhile.
RETRY_BACKOFF_S = 0.5
# What a dead replica raises in the caller.
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
# Routes whose body names a prompt (JSON fields read for the route key).
PROMPT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate",
                 "/v1/responses")


def prompt_token_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int] | None:
    """The prompt's tokens as the replica's engine will see them, for routing only (None
    when the body names no plain prompt: the router then balances the load)."""
    messages = body.get("messages")
    if isinstance(body.get("input"), list):
        messages = body["input"]
    if isinstance(messages, list) and messages:
        return tokenizer.encode_chat(messages)[1]
    for field in ("prompt", "input"):
        prompt = body.get(field)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
    return None


class Ingress:
    """Forwards HTTP requests to the replicas (``deployments``: one handle per served model,
    in the order the models were named; ``on_demand``: the replicas that load the models of
    ``models_dir`` on demand)."""

    def __init__(self, deployments: list[DeploymentHandle], own_metrics: bool = True,
                 on_demand: DeploymentHandle | None = None, models_dir: str | None = None,
                 server: ServerConfig | None = None, tenancy: TenancySettings | None = None
                 ) -> None:
        self.deployments = deployments
        server = self.server = server or ServerConfig()
        # Files and vector stores (stores.py), made when first asked for.
        self._stores: IngressStores | None = None
        # --admin-key: the admin API and project keys, answered and checked here (front.py).
        self.front = FrontDoor(server, tenancy) if server.admin_key is not None else None
        # --allow-runtime-lora-updating: adapters changed on every replica (adapters.py).
        self.adapters = AdapterRoutes(server.admin_key, server.api_key, models_dir)
        # --models-dir: the replicas that load the folder's models a request names.
        self.on_demand = on_demand
        self.models_dir = models_dir
        self._catalog: Catalog | None = None
        self._catalog_lock = asyncio.Lock()
        # /metrics of every replica, answered here (off when /metrics needs the API key:
        # then a replica answers it, with its own numbers, behind its own check).
        self._board = open_board() if own_metrics else None
        # Answers not finished yet, and whether SIGTERM came (new requests then get 503).
        self._in_flight = 0
        self._draining = False

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait up to ``timeout_s`` seconds for the answers in flight
        to finish; how many did not."""
        self._draining = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        return self._in_flight

    async def catalog(self) -> Catalog:
        """The served models, asked of each deployment once (a replica of each is up by the
        time the application is running)."""
        async with self._catalog_lock:
            if self._catalog is None:
                infos = await asyncio.gather(*(
                    d.describe.remote(self.adapters.position(d.deployment_name))
                    for d in self.deployments))
                self._catalog = Catalog([Entry(info, handle) for info, handle
                                         in zip(infos, self.deployments, strict=True)],
                                        self.on_demand, self.models_dir)
            return self._catalog

    async def _route_key(self, entry: Entry, req: HTTPRequestData) -> list[bytes] | None:
        info = entry.info
        if req.method != "POST" or req.path not in PROMPT_ROUTES or info.tokenizer is None:
            return None
        try:
            body = json.loads(req.body)
            ids = await asyncio.to_thread(prompt_token_ids, body, info.tokenizer)
            # An adapter's blocks are chained to its salt in the replica's prefix cache.
            salt = info.salts.get(body.get("model"))
        # A malformed body (the replica answers it): then any replica will do.
        except Exception:
            return None
        return block_hashes(ids, info.block_size, salt=salt) if ids else None

    async def _open(self, entry: Entry, req: HTTPRequestData, caller: Caller | None = None
                    ) -> tuple[ResponseHead, AsyncIterator[Any]]:
        """Send the request (of ``caller``'s project) to a replica of ``entry``'s model; its
        head and the rest."""
        key = await self._route_key(entry, req)
        adapters = self.adapters.position(entry.handle.deployment_name)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            stream = entry.handle.options(stream=True).handle.remote(
                req, **{ROUTE_KEY: key}, caller=caller, adapters=adapters)
            try:
                head = await stream.__anext__()
                return head, stream
            except REPLICA_GONE as e:
                logger.warning("replica gone before answering (try %d of %d): %s",
                               attempt, MAX_ATTEMPTS, e)
                await asyncio.sleep(RETRY_BACKOFF_S * attempt)
        raise ConnectionError(f"no replica answered in {MAX_ATTEMPTS} tries")

    async def _whole(self, entry: Entry, req: HTTPRequestData, caller: Caller | None = None
                     ) -> tuple[ResponseHead, bytes]:
        """A replica's whole (short) answer."""
        head, stream = await self._open(entry, req, caller)
        return head, b"".join([chunk async for chunk in stream])

    async def _everyone(self, req: HTTPRequestData, caller: Caller | None = None) -> Response:
        """A route every model answers (a listing, /health): each deployment's answer, merged
        or the first that is not ok."""
        catalog = await self.catalog()
        everyone = catalog.entries + ([catalog.on_demand] if catalog.on_demand else [])
        answers = await asyncio.gather(*(self._whole(e, req, caller) for e in everyone))
        merged = None
        if req.path in LISTING_ROUTES:
            merged = merge_listings(req.path, [(h.status, body) for h, body in answers])
        if merged is not None:
            merged.headers[REPLICA_HEADER] = ",".join(h.replica for h, _ in answers)
            return merged
        head, body = next(((h, b) for h, b in answers if h.status != 200), answers[0])
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
        headers[REPLICA_HEADER] = head.replica
        return Response(body, status_code=head.status, headers=headers)

    async def _metrics(self, request: Request) -> Response:
        """Every replica's metrics labelled by replica, or one replica's (?replica=NAME)."""
        texts = await self._board.latest.remote()
        replica = request.query_params.get("replica")
        if replica is not None:
            if replica not in texts:
                return JSONResponse({"error": {"message": f"no replica {replica!r}; replicas: "
                                               f"{', '.join(sorted(texts))}",
                                               "type": "invalid_request_error",
                                               "param": "replica"}}, status_code=404)
            return Response(texts[replica], media_type=CONTENT_TYPE_LATEST)
        return Response(aggregate(texts), media_type=CONTENT_TYPE_LATEST)

    async def __call__(self, request: Request) -> Response:
        """Answer one HTTP request through a replica."""
        path = _app_path(request)
        if self._draining:
            if path == "/health":  # as one server answers while it drains
                return JSONResponse({"status": "unavailable", "reason": "shutting down"},
                                    status_code=503)
            return _error(503, "the server is shutting down", "shutting_down")
        if request.method == "GET" and path == "/metrics" and self._board is not None:
            return await self._metrics(request)
        client = request.client
        req = HTTPRequestData(request.method, path, request.url.query.encode(),
                              list(request.headers.raw), await request.body(),
                              (client.host, client.port) if client else None)
        if self.front is not None and is_admin_path(path):
            return await self._answer(run_asgi(self.front.app, req, "ingress"))
        refusal = unsupported(path)
        if refusal is not None:
            return error_response(refusal, path)
        try:
            catalog = await self.catalog()
        except REPLICA_GONE as e:
            return _error(503, f"no replica answered: {e}", "no_replica")
        if request.method == "POST" and path in (LOAD_PATH, UNLOAD_PATH):
            return await self._change_adapter(catalog, req)
        caller, limit_headers = None, {}
        token = project_token(request.scope) if self.front is not None else None
        if token is not None:  # a project's request: admitted by its limits first
            admitted = self.front.admit(token)  # type: ignore[union-attr]
            if isinstance(admitted, APIError):
                return error_response(admitted, path)
            caller, limit_headers = admitted
        self._in_flight += 1
        if not is_store_path(path) and not (
                request.method == "GET" and (path in LISTING_ROUTES or path == "/health")):
            return await self._forward(catalog, req, request, caller, limit_headers)
        try:  # a whole answer of the ingress's store, or of every deployment
            answer = await (self._store_answer(req, caller) if is_store_path(path)
                            else self._everyone(req, caller))
        except ConnectionError as e:  # a model with no replica up
            return _error(503, str(e), "no_replica")
        finally:
            self._finished(caller)
        answer.headers.update(limit_headers)
        return answer

    async def _forward(self, catalog: Catalog, req: HTTPRequestData, request: Request,
                       caller: Caller | None, limit_headers: dict[str, str]) -> Response:
        """Route ``req`` (of ``caller``'s project) to its model's replicas."""
        target = catalog.target(req.method, req.path, dict(request.query_params), req.body)
        try:
            head, stream = await self._open(target.entry, req, caller)
            if target.not_found is not None and head.status == 404:
                # The default model's server found the request well formed, then no model:
                # the 404 names every model, not only its own.
                async for _ in stream:
                    pass
                self._finished(caller)
                return target.not_found
        except BaseException as e:
            self._finished(caller)
            if isinstance(e, ConnectionError):
                return _error(503, str(e), "no_replica")
            raise
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
        headers |= limit_headers
        headers[REPLICA_HEADER] = head.replica
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._body(stream, sse, caller), status_code=head.status,
                                 headers=headers)

    async def stores(self) -> IngressStores | None:
        """The files and vector stores, embedded by the first embedding model (None when no
        model embeds)."""
        catalog = await self.catalog()
        async with self._catalog_lock:
            if self._stores is None:
                embedder = next((e for e in catalog.entries if e.info.task == EMBED), None)
                if embedder is None:
                    return None
                self._stores = IngressStores(self.server, embedder, self._whole, self.front)
            return self._stores

    async def _store_answer(self, req: HTTPRequestData, caller: Caller | None) -> Response:
        """A files or vector stores route, answered by the ingress's store."""
        stores = await self.stores()
        if stores is None:
            return error_response(APIError(404, "files and vector stores need an embedding "
                                           "model: serve one (e.g. --model NAME=PATH,task=embed)",
                                           code="not_found"), req.path)
        return await self._answer(run_asgi(stores.app, req, "ingress", stores.context(caller)))

    async def search(self, vector_store_ids: list[str], query: str, max_num_results: int,
                     filters: Any = None, score_threshold: float = 0.0) -> Any:
        """The file_search tool's search, for a replica (stores.py's ``remote_search``)."""
        stores = await self.stores()
        if stores is None:
            return (400, "the file_search tool needs vector stores, which this server does not "
                    "serve (no embedding model)", "tools", None)
        return await stores.search(vector_store_ids, query, max_num_results, filters,
                                   score_threshold)

    def _finished(self, caller: Caller | None) -> None:
        """An answer ended (its project's concurrency slot is free again)."""
        self._in_flight -= 1
        if caller is not None and self.front is not None:
            self.front.release(caller)

    async def _change_adapter(self, catalog: Catalog, req: HTTPRequestData) -> Response:
        """Load or unload a LoRA adapter on one replica of its base model's deployment and,
        when that succeeds, log it for the others (adapters.py)."""
        authorized = self.adapters.authorize(req)
        if isinstance(authorized, APIError):
            return error_response(authorized, req.path)
        name = self.adapters.model_named(req)
        entry = (catalog.find(name) if name else None) or catalog.default()
        async with self.adapters.lock:
            try:
                head, body = await self._whole(entry, authorized)
            except ConnectionError as e:
                return _error(503, str(e), "no_replica")
            if head.status == 200:
                op = self.adapters.operation(req)
                await self.adapters.record(entry.handle.deployment_name, op)
                async with self._catalog_lock:
                    self._catalog = None  # the adapters' names and salts changed
                if self.front is not None:
                    self.front.audit("lora.loaded" if op.module else "lora.unloaded",
                                     {"name": op.name} | ({"path": op.module.path}
                                                          if op.module else {}))
        return self._response(head, body)

    async def _answer(self, parts: AsyncIterator[ResponseHead | bytes]) -> Response:
        """The whole answer of an app run here (the admin routes)."""
        head = await parts.__anext__()
        assert isinstance(head, ResponseHead)
        return self._response(head, b"".join([p async for p in parts]))  # type: ignore[misc]

    @staticmethod
    def _response(head: ResponseHead, body: bytes) -> Response:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
        headers[REPLICA_HEADER] = head.replica
        return Response(body, status_code=head.status, headers=headers)

    async def _body(self, stream: AsyncIterator[bytes], sse: bool, caller: Caller | None
                    ) -> AsyncIterator[bytes]:
        """The rest of the replica's answer; an error event if the replica dies mid-stream."""
        try:
            async for chunk in stream:
                yield chunk
        except REPLICA_GONE as e:
            logger.warning("replica died while streaming: %s", e)
            if sse:
                error = {"error": {"message": "the replica serving this stream died",
                                   "type": "server_error", "code": "replica_died"}}
                yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            self._finished(caller)


def _app_path(request: Request) -> str:
    """The path below the application's route prefix (the replica's app is at /)."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


def _error(status: int, message: str, code: str) -> JSONResponse:
    """An error of the ingress itself, in OpenAI's shape."""
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": code}}, status_code=status)
