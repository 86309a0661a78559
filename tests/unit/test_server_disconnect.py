"""A non-streaming request whose client is already gone when its answer starts being collected
is aborted, however early the disconnect came."""

from __future__ import annotations

import asyncio

from tokenmill.server.serving import collect_unless_gone


class Group:
    """Stands in for an engine RequestGroup whose requests never finish by themselves."""

    def __init__(self) -> None:
        self.closed = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()  # nothing ever arrives

    def close(self) -> None:
        self.closed += 1


async def gone() -> dict:
    return {"type": "http.disconnect"}


def test_a_client_gone_before_collecting_starts_closes_the_group() -> None:
    group = Group()
    assert asyncio.run(collect_unless_gone(group, 1, 1, gone)) is None  # type: ignore[arg-type]
    assert group.closed >= 1


def test_a_client_leaving_while_collecting_closes_the_group() -> None:
    group = Group()
    left = asyncio.Event()

    async def leaves_later() -> dict:
        await left.wait()
        return {"type": "http.disconnect"}

    async def run() -> object:
        job = asyncio.ensure_future(collect_unless_gone(group, 1, 1, leaves_later))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        assert not job.done() and group.closed == 0
        left.set()
        return await job

    assert asyncio.run(run()) is None
    assert group.closed >= 1
