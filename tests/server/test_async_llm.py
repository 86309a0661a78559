"""AsyncLLM's thread hand-off, admission and failure paths, on a fake engine (no model)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, StepLoop
from tokenmill.metrics.stats import SchedulerStats
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams


class FakeEngine:
    """One token per step per request; ``add_request`` rejects the prompt "bad" like the
    real engine rejects what can never run; ``fail`` makes the next step raise."""

    def __init__(self, max_num_seqs: int = 2) -> None:
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs))
        self.last_batch = (0, 0)
        self.stats = SchedulerStats
        # close(): AsyncLLM.shutdown stops the engine's tensor-parallel workers with it.
        self.closed = False
        self.parents: dict[str, None] = {}
        self.requests: dict[str, tuple[int, int]] = {}  # id -> (generated, max_tokens)
        self.aborted: list[str] = []
        self.steps = 0
        self.fail = False

    def add_request(self, rid: str, prompt: object, params: SamplingParams, kind: object,
                    arrival_time: float, grammar: object | None = None,
                    lora_request: object | None = None) -> None:
        if prompt == "bad":
            raise ValueError("the request needs more KV cache than there is")
        self.requests[rid] = (0, params.max_tokens or 1)
        self.parents[rid] = None

    def _output(self, rid: str, tokens: list[int], reason: str | None) -> RequestOutput:
        return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "x" * len(tokens), tokens,
                                                                  reason)],
                             reason is not None, RequestMetrics(arrival_time=time.monotonic()))

    def abort_request(self, rid: str) -> RequestOutput | None:
        if self.requests.pop(rid, None) is None:
            return None
        self.aborted.append(rid)
        del self.parents[rid]
        return self._output(rid, [], "abort")

    def unfinished_request_ids(self) -> list[str]:
        return list(self.parents)

    def close(self) -> None:
        self.closed = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.fail:
            raise RuntimeError("boom")
        time.sleep(0.001)  # a forward pass takes time; without it the thread floods the loop
        self.steps += 1
        self.last_batch = (len(self.requests), len(self.requests))
        outs = []
        for rid, (done, limit) in list(self.requests.items()):
            finished = done + 1 >= limit
            outs.append(self._output(rid, [7], "length" if finished else None))
            self.requests[rid] = (done + 1, limit)
            if finished:
                del self.requests[rid]
                del self.parents[rid]
        return outs


def run(coro_fn, engine: FakeEngine, max_queue: int = 2):
    async def main():
        client = AsyncLLM(engine, max_queue=max_queue)  # type: ignore[arg-type]
        client.start()
        try:
            return await coro_fn(client)
        finally:
            await client.shutdown()
    return asyncio.run(main())


def test_outputs_flow_back_per_prompt() -> None:
    async def go(client: AsyncLLM) -> dict[int, int]:
        group = await client.submit(["a", "b"], SamplingParams(max_tokens=3))
        counts = {0: 0, 1: 0}
        async for index, out in group:
            counts[index] += len(out.outputs[0].token_ids)
        assert client.num_seqs_in_flight == 0
        return counts

    assert run(go, FakeEngine()) == {0: 3, 1: 3}


def test_engine_thread_value_error_is_raised_and_nothing_stays_queued() -> None:
    engine = FakeEngine()

    async def go(client: AsyncLLM) -> None:
        with pytest.raises(ValueError, match="KV cache"):
            await client.submit(["ok", "bad"], SamplingParams(max_tokens=10_000))
        assert client.num_seqs_in_flight == 0
        await asyncio.sleep(0.1)

    run(go, engine)
    assert not engine.requests and engine.aborted  # the accepted sibling was aborted


def test_overload_and_capacity() -> None:
    async def go(client: AsyncLLM) -> None:
        with pytest.raises(ValueError, match="at most 4"):
            await client.submit(["a"], SamplingParams(n=5))
        group = await client.submit(["a", "b", "c"], SamplingParams(max_tokens=1000))
        with pytest.raises(EngineOverloadedError):
            await client.submit(["d", "e"], SamplingParams())
        group.close()
        assert client.num_seqs_in_flight == 0
        finished = [out.finished async for _, out in
                    await client.submit(["d", "e"], SamplingParams(max_tokens=1))]
        assert finished == [True, True]

    run(go, FakeEngine())


def test_close_aborts_in_engine_and_loop_sleeps_when_idle() -> None:
    engine = FakeEngine()

    async def go(client: AsyncLLM) -> None:
        group = await client.submit(["a"], SamplingParams(max_tokens=10_000))
        await asyncio.sleep(0.05)
        group.close()
        assert await client.wait_idle(1.0)
        await asyncio.sleep(0.1)
        steps = engine.steps
        await asyncio.sleep(0.3)
        assert engine.steps == steps  # idle: no busy stepping

    run(go, engine)
    assert engine.aborted and not engine.requests
    assert engine.closed


def test_step_failure_fails_requests_and_refuses_new_ones() -> None:
    engine = FakeEngine()

    async def go(client: AsyncLLM) -> None:
        group = await client.submit(["a"], SamplingParams(max_tokens=10_000))
        engine.fail = True
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in group:
                pass
        assert client.dead is not None and client.dead.is_set()
        with pytest.raises(EngineDeadError):
            await client.submit(["b"], SamplingParams())

    run(go, engine)


def test_engines_share_one_step_loop_and_one_failure_stays_its_own() -> None:
    """Two engines on one StepLoop: both answer, from its one thread; when one engine's step
    raises, only its requests fail and the other keeps serving; the thread ends with the
    last engine."""
    chat, embed = FakeEngine(), FakeEngine()
    loop = StepLoop()

    async def main() -> None:
        a = AsyncLLM(chat, step_loop=loop)  # type: ignore[arg-type]
        b = AsyncLLM(embed, step_loop=loop)  # type: ignore[arg-type]
        a.start()
        b.start()
        thread = loop._thread
        assert thread is not None and thread.is_alive()
        ga = await a.submit(["x"], SamplingParams(max_tokens=3))
        gb = await b.submit(["y"], SamplingParams(max_tokens=5))
        assert [len(o.outputs[0].token_ids) async for _, o in ga] == [1, 1, 1]
        assert [len(o.outputs[0].token_ids) async for _, o in gb] == [1] * 5
        doomed = await a.submit(["x"], SamplingParams(max_tokens=10_000))
        chat.fail = True
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in doomed:
                pass
        assert a.dead is not None and a.dead.is_set() and not b.dead.is_set()
        finished = [o.finished async for _, o in
                    await b.submit(["z"], SamplingParams(max_tokens=2))]
        assert finished == [False, True]
        await a.shutdown()
        await b.shutdown()
        assert embed.closed and chat.closed
        thread.join(timeout=5)
        assert not thread.is_alive() and loop._thread is None

    asyncio.run(main())
