"""What a request must carry before any route sees it: a Host that names this server and an
Origin it trusts. Together with the JSON content type the routes demand, this keeps a web page in
the user's browser from driving a server on their machine (CSRF, DNS rebinding).

The rules:
- ``Host`` must be an IP address (a rebinding attack needs a domain name it controls), a
  ``localhost`` name, this machine's host name, the address the server is bound to, or one of
  ``allowed_hosts`` (``*`` allows any, ``.example.com`` a domain and its subdomains).
- ``Origin``, when a browser sends one, must be the server's own (same scheme-less host and port
  as ``Host``) or one of ``allowed_origins`` (``*`` allows any); CORS answers are sent only for
  ``allowed_origins``, so without them no other page can read a response.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.api.errors import APIError
from tokenmill.server.errors import is_ollama_path


def split_host(host: str) -> tuple[str, str | None]:
    """``host[:port]`` (IPv6 in brackets) as (lower-case name without a trailing dot, port)."""
    host = host.strip()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    else:
        name, sep, port_s = host.rpartition(":")
        name, port = (name, port_s) if sep and port_s.isdigit() else (host, None)
    return name.lower().rstrip("."), port


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which ``Host`` names and ``Origin`` values the server answers."""

    def __init__(self, bind_host: str, allowed_hosts: Iterable[str] = (),
                 allowed_origins: Iterable[str] = ()) -> None:
        self.any_host = "*" in allowed_hosts
        names = {bind_host, "localhost", socket.gethostname(), socket.getfqdn()}
        self.names = {split_host(n)[0] for n in names} | {
            split_host(h)[0] for h in allowed_hosts if not h.startswith(".")}
        self.domains = tuple(h.lower().rstrip(".") for h in allowed_hosts if h.startswith("."))
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins if o != "*"}

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request with this ``Host`` header may be answered (None: no header, as in
        HTTP/1.0, which no browser sends)."""
        if host is None or self.any_host:
            return True
        name, _ = split_host(host)
        return (_is_ip(name) or name in self.names or name.endswith(".localhost")
                or any(name == d[1:] or name.endswith(d) for d in self.domains))

    def origin_allowed(self, origin: str | None, host: str | None, scheme: str = "http") -> bool:
        """Whether a request from this ``Origin`` (None: not from a browser page) may be
        answered: the server's own origin (``scheme``://``host``), or an allowed one."""
        if origin is None or self.any_origin:
            return True
        origin = origin.rstrip("/").lower()
        if origin in self.origins:
            return True
        parts = urlsplit(origin)
        if host is None or parts.scheme not in ("http", "https") or not parts.netloc:
            return False
        o_name, o_port = split_host(parts.netloc)
        h_name, h_port = split_host(host)
        return (parts.scheme == scheme and o_name == h_name
                and (o_port or _default_port(scheme)) == (h_port or _default_port(scheme)))


def _default_port(scheme: str) -> str:
    return "443" if scheme == "https" else "80"


class RequestGuard:
    """ASGI middleware: refuse requests whose Host or Origin the policy does not allow, with
    the API's error body (400 for a Host, 403 for an Origin; Ollama's under /api/)."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        err = None
        if not self.policy.host_allowed(host):
            err = APIError(400, f"the Host header {host!r} does not name this server; start it "
                           "with --allowed-hosts to accept it", param="host",
                           code="invalid_host")
        elif not self.policy.origin_allowed(origin, host, scope.get("scheme", "http")):
            err = APIError(403, f"requests from the origin {origin!r} are not allowed; start the "
                           "server with --allowed-origins to accept them", param="origin",
                           code="origin_not_allowed")
        if err is None:
            await self.app(scope, receive, send)
            return
        await _send_error(send, err, scope.get("path", ""))


async def _send_error(send: Send, err: APIError, path: str) -> None:
    body = (json.dumps({"error": err.message}).encode() if is_ollama_path(path)
            else err.body().model_dump_json().encode())
    start: dict[str, Any] = {
        "type": "http.response.start", "status": err.status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())]}
    await send(start)
    await send({"type": "http.response.body", "body": body})
