"""Asynchronous scheduling on the real engine: step n+1 is scheduled and launched before step
n's tokens reach the host, its inputs taken from step n's samples on the device.

The CPU runs it too (nothing overlaps there: the host is the device), so every path is
checked here against the step-by-step engine. The deterministic engine makes a request's
tokens independent of its batch mates, which differ between the two schedules (a request
that stops is computed one step further, and admissions move by a step); without it the
int4 kernels' batch-dependent rounding could flip a near tie.
"""

from __future__ import annotations

import argparse

import pytest
from engine_workload import CHOICE_ROW, PROMPTS, assert_same_outputs, feature_workload, summarize

from tokenmill import LLM, SamplingParams
from tokenmill.engine.args import add_engine_args, engine_config_from_args
from tokenmill.runner.launched import LaunchedStep
from tokenmill.runner.model_runner import ModelRunner


def _engine(async_scheduling: bool, **kw: object) -> LLM:
    # 14 blocks of 16 tokens for up to 6 sequences of up to ~90 tokens: they preempt.
    return LLM(deterministic=True, max_model_len=256, num_kv_blocks=14, max_num_seqs=6,
               max_num_batched_tokens=64, async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module")
def step_by_step() -> LLM:
    return _engine(False)


@pytest.fixture(scope="module")
def pipelined() -> LLM:
    return _engine(True)


def test_pipelined_engine_gives_the_step_by_step_outputs(step_by_step: LLM,
                                                         pipelined: LLM) -> None:
    assert pipelined.engine.core.async_scheduling
    assert not step_by_step.engine.core.async_scheduling
    prompts, params = feature_workload()
    expected = summarize(step_by_step.generate(prompts, params, use_tqdm=False))
    assert_same_outputs(summarize(pipelined.generate(prompts, params, use_tqdm=False)),
                        expected)
    assert pipelined.engine.core.scheduler.num_preemptions_total > 0
    # Every block is back, and nothing is left in flight.
    kv = pipelined.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    assert not pipelined.engine.has_unfinished_requests()
    # The workload stops requests every way: by length, EOS or stop string, and a grammar.
    assert {"length", "stop"} <= {row[2] for row in expected}
    assert expected[CHOICE_ROW][1] in ("yes", "no")


class _Trace:
    """Records the order of the runner's launches and the finishes of launched steps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, int]] = []
        launch, finish = ModelRunner.launch, LaunchedStep.finish
        trace = self

        def traced_launch(runner: ModelRunner, *args: object) -> LaunchedStep:
            step = launch(runner, *args)  # type: ignore[arg-type]
            step._trace_id = len(trace.events)  # type: ignore[attr-defined]
            trace.events.append(("launch", step._trace_id))  # type: ignore[attr-defined]
            return step

        def traced_finish(step: LaunchedStep):  # noqa: ANN202
            if step.sampled is not None:
                trace.events.append(("finish", step._trace_id))  # type: ignore[attr-defined]
            return finish(step)

        monkeypatch.setattr(ModelRunner, "launch", traced_launch)
        monkeypatch.setattr(LaunchedStep, "finish", traced_finish)

    def overlapped(self) -> int:
        """How many steps were launched while an earlier one had not finished."""
        open_steps: set[int] = set()
        count = 0
        for kind, sid in self.events:
            if kind == "launch":
                count += bool(open_steps)
                open_steps.add(sid)
            else:
                open_steps.discard(sid)
        return count


def test_steps_overlap_only_when_the_next_needs_nothing_from_the_host(
        pipelined: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = _Trace(monkeypatch)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pipelined.generate(PROMPTS[:2], [plain, plain], use_tqdm=False)
    # Prefill, then 11 decode steps: every launch after the first overlaps the one before.
    assert trace.overlapped() >= 10
    for params in (SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
                   SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5)):
        trace.events.clear()
        pipelined.generate(PROMPTS[:1], [params], use_tqdm=False)
        assert trace.overlapped() == 0, params


def test_abort_while_a_step_is_in_flight(step_by_step: LLM, pipelined: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = step_by_step.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = pipelined.engine
    engine.add_request("keep", PROMPTS[1], params)
    engine.add_request("drop", PROMPTS[2], params)
    outputs = {}
    for n in range(60):
        if not engine.has_unfinished_requests():
            break
        if n == 4:
            assert engine.core._in_flight is not None  # a step is on the device
            engine.abort_request("drop")
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["keep"].outputs[0].token_ids == expected
    assert "drop" not in outputs or not outputs["drop"].finished
    kv = engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_where_it_is_on_and_where_it_is_refused() -> None:
    # On the CPU it is off unless asked for: nothing to overlap.
    llm = LLM(max_model_len=128, num_kv_blocks=16)
    assert not llm.engine.core.async_scheduling
    del llm
    # An embedding engine computes each request in one step: it never overlaps, asked or not
    # (a server's options reach its embedding engine too).
    embed = LLM(task="embed", async_scheduling=True)
    assert not embed.engine.core.async_scheduling
    del embed
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(max_model_len=128, num_kv_blocks=16, speculative="ngram", async_scheduling=True)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).scheduler.async_scheduling is None
    assert engine_config_from_args(
        p.parse_args(["--async-scheduling"])).scheduler.async_scheduling is True
    assert engine_config_from_args(
        p.parse_args(["--no-async-scheduling"])).scheduler.async_scheduling is False
