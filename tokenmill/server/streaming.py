"""Server-sent events of engine outputs, and the end of a request whose client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.api.errors import APIError
from tokenmill.api.response_building import StreamChunks, StreamUsage, engine_error
from tokenmill.engine.async_llm import EngineDeadError, RequestGroup

T = TypeVar("T")


def sse(data: str) -> str:
    """One server-sent event."""
    return f"data: {data}\n\n"


def error_event(err: APIError) -> str:
    """An error in the middle of a stream: the openai client raises it as an APIError."""
    return sse(err.body().model_dump_json())


async def stream_events(group: RequestGroup, chunks: StreamChunks,
                        include_usage: bool) -> AsyncIterator[str]:
    """The events of a streamed response: the chunks of each output, the usage when asked,
    then ``[DONE]``; an engine failure ends the stream with an error event and ``[DONE]``."""
    for chunk in chunks.opening():
        yield sse(chunk.model_dump_json())
    usage = StreamUsage()
    try:
        async for index, out in group:
            usage.add(index, out)
            delta = chunks.delta(index, out)
            if delta is not None:
                yield sse(delta.model_dump_json())
    except EngineDeadError as e:
        yield error_event(engine_error(e))
        yield sse("[DONE]")
        return
    if include_usage:
        yield sse(chunks.usage(usage.info()).model_dump_json())
    yield sse("[DONE]")


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone away (after the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T | None:
    """Await ``work``, cancelling it (None) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():  # the client left (or we are cancelled): stop the work too
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


class EngineStreamingResponse(StreamingResponse):
    """A server-sent-event stream of engine outputs that stops at the client's disconnect.

    ``on_close`` runs however the response ends (finished, client gone, error, never started),
    so the engine requests behind it are always aborted or already finished.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 media_type: str = "text/event-stream") -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self.stream_response(send))
        except OSError:  # the client went away while we were writing
            pass
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
