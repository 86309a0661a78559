"""The server with asynchronous scheduling (the GPU's default, asked for here on the CPU):
concurrent streams, a stop string and a client that leaves mid-stream, against the same
server stepping one step at a time. Both are deterministic (a request's tokens do not depend
on its batch mates), so every text must match."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
from server_harness import Server, idle, leave_mid_stream, start_server, wait_for

PROMPTS = [f"Story {i}: once upon a time" for i in range(6)]


async def _stream(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[str, str]:
    extra: dict[str, object] = {"ignore_eos": True}
    stop = [" the"] if i == 3 else None
    stream = await client.completions.create(
        model=model, prompt=PROMPTS[i], max_tokens=12 + 4 * i, temperature=0.0, stream=True,
        stop=stop, extra_body=extra)
    text, finish = "", ""
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


async def _run(server: Server) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    results = await asyncio.gather(leave_mid_stream(server),
                                   *[_stream(client, server.model, i) for i in range(6)])
    await client.close()
    return list(results[1:])


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[bool, Server]]:
    started = {}
    try:
        for on in (False, True):
            flag = "--async-scheduling" if on else "--no-async-scheduling"
            started[on] = start_server(flag, "--deterministic", "--max-num-seqs", "8")
        yield started
    finally:
        for s in started.values():
            assert s.stop() == 0, s.log()


def test_async_server_streams_what_the_step_by_step_server_streams(
        servers: dict[bool, Server]) -> None:
    assert "asynchronous scheduling: on" in servers[True].log()
    assert "asynchronous scheduling: off" in servers[False].log()
    expected = asyncio.run(_run(servers[False]))
    got = asyncio.run(_run(servers[True]))
    assert got == expected
    assert {f for _, f in expected} == {"length", "stop"}
    # The client that hung up was aborted: nothing is left running, no block is held.
    server = servers[True]
    assert wait_for(lambda: idle(server)), server.log()
