"""Files and vector stores under ``--replicas``, served by the ingress: one retrieval service
(tokenmill/retrieval) over the data folder of the ingress's machine, as one server keeps it,
embedding through the replicas of the first embedding model (``POST /v1/embeddings`` sent to
its deployment). The routes are the single server's (``retrieval_router``), behind its API
key; a project's objects are its own (the object guard, over the one tenancy store).

The Responses API's ``file_search`` tool runs on a replica, whose search asks the ingress
(``Ingress.search``): the one store answers every replica. Batches (``/v1/batches``) run on
one server's engines and are refused under ``--replicas``.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request

from tokenmill.api.errors import APIError
from tokenmill.config import ServerConfig
from tokenmill.retrieval.embedder import TokenizerEmbedder
from tokenmill.retrieval.service import RetrievalService, default_data_dir
from tokenmill.serve_ray.catalog import Entry
from tokenmill.serve_ray.messages import HTTPRequestData, ResponseHead
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.launcher import load_models
from tokenmill.server.retrieval_routes import retrieval_limits, retrieval_router
from tokenmill.server.tenancy_objects import ObjectGuard
from tokenmill.tenancy.meter import Tab, current_tab
from tokenmill.tenancy.store import Caller

# Texts per embedding request to the deployment.
EMBED_SLICE = 32
STORE_PREFIXES = ("/v1/files", "/v1/vector_stores")

Forward = Callable[[Entry, HTTPRequestData], Awaitable[tuple[ResponseHead, bytes]]]


def is_store_path(path: str) -> bool:
    """Whether the ingress's store answers ``path``."""
    return any(path == p or path.startswith(p + "/") for p in STORE_PREFIXES)


class IngressStores:
    """The retrieval service at the ingress and the app of its routes. ``embedder``: the
    first embedding model's entry; ``forward``: how the ingress gets a replica's answer."""

    def __init__(self, config: ServerConfig, embedder: Entry, forward: Forward,
                 tenancy: Any = None) -> None:
        self.config = config
        self._entry = embedder
        self._forward = forward
        info = embedder.info
        assert info.tokenizer is not None
        self.service = RetrievalService(config.data_dir or default_data_dir(), TokenizerEmbedder(
            self._embed, info.tokenizer.backend, info.max_model_len))
        # The front door's store and limiter (projects), None without an admin key.
        self._tenancy = tenancy
        self.state = load_models([], config)  # no engines: the API key and the limits
        self.app = self._build()

    async def _embed(self, texts: list[str]) -> list[list[float]]:
        """The embedding deployment's vectors of ``texts``, in slices."""
        headers = [(b"content-type", b"application/json")]
        if self.config.api_key is not None:
            headers.append((b"authorization", f"Bearer {self.config.api_key}".encode()))
        vectors: list[list[float]] = []
        for i in range(0, len(texts), EMBED_SLICE):
            body = json.dumps({"model": self._entry.info.name,
                               "input": texts[i:i + EMBED_SLICE]}).encode()
            head, answer = await self._forward(self._entry, HTTPRequestData(
                "POST", "/v1/embeddings", b"", headers, body))
            if head.status != 200:
                raise RuntimeError(f"the embedding model answered {head.status}: "
                                   f"{answer[:300]!r}")
            data = sorted(json.loads(answer)["data"], key=lambda d: d["index"])
            vectors.extend(d["embedding"] for d in data)
        return vectors

    def _build(self) -> Any:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        app.state.tokenmill = self.state
        install_error_handlers(app)

        async def require_key(request: Request) -> None:
            # A project key was checked by the ingress (it set the request's project).
            if current_tab.get() is None and not self.state.key_matches(
                    request.headers.get("authorization")):
                raise APIError(401, "missing or invalid API key (send Authorization: Bearer "
                               "<key>)", code="invalid_api_key")

        app.include_router(retrieval_router(self.service, retrieval_limits(self.config)),
                           dependencies=[Depends(require_key)])
        if self._tenancy is None:
            return app
        return ObjectGuard(app, store=self._tenancy.store,
                           server_key=self.config.api_key is not None)

    def context(self, caller: Caller | None) -> contextvars.Context | None:
        """The context a request of ``caller``'s project runs in here (None: no project)."""
        if caller is None or self._tenancy is None:
            return None
        context = contextvars.copy_context()
        context.run(current_tab.set, Tab(caller, self._tenancy.store, self._tenancy.limiter))
        return context

    async def search(self, vector_store_ids: list[str], query: str, max_num_results: int,
                     filters: Any = None, score_threshold: float = 0.0
                     ) -> list[Any] | tuple[int, str, str | None, str | None]:
        """The service's search for a replica's file_search; an APIError as plain data
        (status, message, param, code), which the replica raises again."""
        try:
            return await self.service.search(vector_store_ids, query, max_num_results,
                                             filters, score_threshold)
        except APIError as e:
            return e.status, e.message, e.param, e.code


def remote_search(ingress: Callable[[], Any]) -> Callable[..., Awaitable[list[Any]]]:
    """A replica's SearchFn over the ingress's ``search`` (``ingress``: gets its handle)."""

    async def search(vector_store_ids: list[str], query: str, max_num_results: int,
                     filters: Any = None, score_threshold: float = 0.0) -> list[Any]:
        found = await ingress().search.remote(vector_store_ids, query, max_num_results, filters,
                                            score_threshold)
        if isinstance(found, tuple):
            status, message, param, code = found
            raise APIError(status, message, param=param, code=code)
        return found

    return search
