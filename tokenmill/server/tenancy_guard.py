"""Project keys at the door (ASGI middleware): a request bearing a project key (``sk-proj-``)
is its project's, limited by its project's limits; any other request goes on to the server's
own key check unchanged.

- An unknown or revoked key, or one of an archived project: 401 with the same message as any
  bad key (the caller learns nothing about which keys exist).
- Over a limit: 429 with OpenAI's ``x-ratelimit-*`` headers and ``Retry-After``.
- Admitted: the request runs with ``tenancy.meter.current_tab`` set (the engine requests it
  queues are metered and prioritised for the project); its answer carries the headers.
"""

from __future__ import annotations

import json

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.api.errors import APIError
from tokenmill.server.errors import is_ollama_path
from tokenmill.server.state import bearer_token
from tokenmill.tenancy.keys import looks_like_project_key
from tokenmill.tenancy.limits import Limiter, retry_after
from tokenmill.tenancy.meter import Tab, current_tab
from tokenmill.tenancy.metrics import ProjectMetrics
from tokenmill.tenancy.retention import UsagePruner
from tokenmill.tenancy.store import Caller, TenancyStore

# The same words as the server key's refusal (app.py), whichever key was wrong.
BAD_KEY = "missing or invalid API key (send Authorization: Bearer <key>)"
# The admin routes check the admin key themselves.
ADMIN_PREFIXES = ("/v1/organization", "/admin")


class TenancyGuard:
    """Resolve project keys to their project, and apply the project's limits."""

    def __init__(self, app: ASGIApp, store: TenancyStore, limiter: Limiter,
                 metrics: ProjectMetrics | None = None, content: bool = False,
                 pruner: UsagePruner | None = None) -> None:
        self.app = app
        self.pruner = pruner
        self.content = content
        self.store = store
        self.limiter = limiter
        self.metrics = metrics

    def admit(self, token: str) -> tuple[Caller, dict[str, str]] | APIError:
        """The caller of a project key and its rate-limit headers, its request counted (the
        caller's ``limiter.release`` ends it); or the refusal (401, 429) to answer."""
        caller = self.store.caller(token)
        if caller is None:
            return APIError(401, BAD_KEY, code="invalid_api_key")
        project = caller.project
        refusal = self.limiter.admit(project)
        if refusal is not None:
            if self.metrics is not None:
                self.metrics.refused.labels(project.id, refusal.code).inc()
            headers = {**self.limiter.headers(project),
                       "Retry-After": retry_after(refusal.retry_after_s)}
            return APIError(429, refusal.message, code=refusal.code, headers=headers)
        return caller, self.limiter.headers(project)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        token = project_token(scope)
        if token is None or current_tab.get() is not None:
            # No project key, or one a Ray Serve ingress already admitted.
            await self.app(scope, receive, send)
            return
        admitted = self.admit(token)
        if isinstance(admitted, APIError):
            await send_error(send, admitted, path)
            return
        caller, headers = admitted

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start" and headers:
                message["headers"] = [*message.get("headers", []),
                                      *((k.encode(), v.encode()) for k, v in headers.items())]
            await send(message)

        reset = current_tab.set(Tab(caller, self.store, self.limiter, self.metrics,
                                    self.content))
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            current_tab.reset(reset)
            self.limiter.release(caller.project.id)
            if self.pruner is not None:  # on its own thread, not awaited
                self.pruner.maybe_prune()


def project_token(scope: Scope) -> str | None:
    """The project key (``sk-proj-``) a request bears, outside the admin routes (which check
    the admin key themselves); None for any other request."""
    path = scope.get("path", "")
    token = (bearer_token(Headers(scope=scope).get("authorization"))
             if scope["type"] == "http" and not path.startswith(ADMIN_PREFIXES) else None)
    return token if token is not None and looks_like_project_key(token) else None


async def send_error(send: Send, err: APIError, path: str) -> None:
    """Answer ``err`` (Ollama's body under /api/) with its headers."""
    body = (json.dumps({"error": err.message}).encode() if is_ollama_path(path)
            else err.body().model_dump_json().encode())
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
