"""Every response carries an ``x-request-id`` header: the client's own when it sent a usable
one (so its logs and ours name the same request), else a new one. Clients such as the openai
library read it from error responses to report the request."""

from __future__ import annotations

import re
import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
# A client's id is echoed only if it is short printable ASCII without separators of its own.
_USABLE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id(scope: Scope) -> str:
    """The client's usable ``x-request-id``, else a new random one."""
    for name, value in scope.get("headers", ()):
        if name == HEADER.encode():
            text = value.decode("latin-1").strip()
            if _USABLE.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """ASGI middleware: add ``x-request-id`` to every HTTP response (streamed ones included:
    the header goes out with the start of the response)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)
