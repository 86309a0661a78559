"""Asynchronous scheduling in the scheduler: step n+1 scheduled before step n's tokens are
appended, with a fake runner and no model.

The fake runner samples, for a request whose step reaches the end of its sequence, the token
``100 + its position among the outputs``; the position is known when the step is scheduled,
so a pipelined run must give every request the tokens a step-by-step run gives it.
"""

from __future__ import annotations

import pytest
from test_scheduler import make_request, run_to_end
from test_scheduler import make_scheduler as make_step_by_step

from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import RequestStatus


def make_scheduler(**kw: int) -> Scheduler:
    """test_scheduler's scheduler, pipelined."""
    sched = make_step_by_step(**kw)  # type: ignore[arg-type]
    sched.pipelined = True
    return sched


def fake_launch(sched: Scheduler, out: SchedulerOutput) -> RunnerOutput:
    """What the runner will report for ``out``, decided when it is scheduled: a request that
    samples this step has its computed tokens one short of its tokens plus those in flight."""
    result = RunnerOutput()
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        if req.num_computed_tokens == req.num_tokens + req.num_pending_tokens - 1:
            result.sampled_token_ids[rid] = [100 + req.num_computed_tokens - req.num_prompt_tokens]
    return result


def run_pipelined(sched: Scheduler, max_steps: int = 1000,
                  abort_at: dict[int, str] | None = None) -> dict[str, list[int]]:
    """Schedule step n+1, then update step n, as EngineCore.step does asynchronously."""
    outputs: dict[str, list[int]] = {}
    in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None
    for step in range(max_steps):
        if not sched.has_unfinished() and in_flight is None:
            return outputs
        if abort_at and step in abort_at:
            sched.finish_requests([abort_at[step]], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        launched = (out, fake_launch(sched, out))
        previous, in_flight = in_flight, (None if out.is_empty else launched)
        if previous is not None:
            for o in sched.update(*previous):
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if out.is_empty:
            sched.update(*launched)
    raise AssertionError("the pipelined scheduler did not finish: it hangs")


def _requests(sched: Scheduler) -> None:
    sched.add_request(make_request("short", 3, max_tokens=5))
    sched.add_request(make_request("long", 40, max_tokens=12))
    sched.add_request(make_request("one", 7, max_tokens=1))
    sched.add_request(make_request("stops", 5, max_tokens=30, stop_token_ids=[104]))
    sched.add_request(make_request("late", 9, max_tokens=9))


@pytest.mark.parametrize("budget", [64, 8])
def test_pipelined_run_gives_the_step_by_step_tokens(budget: int) -> None:
    expected = run_to_end(_fill(make_step_by_step(budget=budget)))
    sched = _fill(make_scheduler(budget=budget))
    assert run_pipelined(sched) == expected
    assert expected["stops"] == [100, 101, 102, 103, 104]
    assert len(expected["long"]) == 12 and expected["one"] == [100]
    # Every block is back (a request stopped while a step in flight computed for it too).
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert not sched.requests


def _fill(sched: Scheduler) -> Scheduler:
    _requests(sched)
    return sched


def test_pipelined_run_with_preemptions() -> None:
    # 12 blocks of 4 tokens for five requests of up to 52 tokens: they preempt each other.
    expected = run_to_end(_fill(make_step_by_step(num_blocks=14)))
    sched = _fill(make_scheduler(num_blocks=14))
    assert run_pipelined(sched) == expected
    assert sched.num_preemptions_total > 0
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_a_token_in_flight_counts_when_scheduling() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 6, max_tokens=3))
    first = sched.schedule()  # the prompt; it samples the first output
    req = sched.requests["a"]
    assert first.num_scheduled_tokens == {"a": 6} and req.num_pending_tokens == 1
    # Scheduled again before the first token is appended: one token, the one in flight.
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    assert req.num_computed_tokens == 7 and req.num_pending_tokens == 2
    sched.update(first, fake_launch_result("a", 100))
    assert req.output_token_ids == [100] and req.num_pending_tokens == 1
    # The token in flight (the second) is not the last: the third is scheduled.
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    sched.update(second, fake_launch_result("a", 101))
    # The third token ends the request by length: nothing is scheduled after it.
    assert sched.schedule().num_scheduled_tokens == {}
    outs = sched.update(third, fake_launch_result("a", 102))
    assert outs[0].finish_reason == "length" and "a" not in sched.requests


def fake_launch_result(rid: str, token: int) -> RunnerOutput:
    out = RunnerOutput()
    out.sampled_token_ids[rid] = [token]
    return out


def test_a_request_stopping_in_flight_drops_the_next_steps_work() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=10))
    first = sched.schedule()
    second = sched.schedule()
    outs = sched.update(first, fake_launch_result("a", 2))  # EOS
    assert outs[0].finish_reason == "stop" and outs[0].new_token_ids == [2]
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
    # The step scheduled before the stop was known reports a token: nobody gets it.
    assert sched.update(second, fake_launch_result("a", 7)) == []
    nxt = sched.schedule()
    assert nxt.finished_request_ids == {"a"} and nxt.is_empty


def test_abort_while_a_step_is_in_flight() -> None:
    expected = run_to_end(_fill(make_step_by_step()))
    sched = _fill(make_scheduler())
    got = run_pipelined(sched, abort_at={4: "long"})
    assert len(got.get("long", [])) < len(expected["long"])
    for rid in ("short", "one", "stops", "late"):
        assert got[rid] == expected[rid]
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_an_embedding_request_is_not_scheduled_again_while_its_step_runs() -> None:
    from tokenmill.request import Request
    from tokenmill.sampling_params import PoolingParams, SamplingParams

    sched = make_scheduler()
    embed = Request("e", [10, 11, 12, 13, 14], SamplingParams(max_tokens=1),
                    pooling_params=PoolingParams())
    sched.add_request(embed)
    sched.add_request(make_request("g", 4, max_tokens=3))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"e": 5, "g": 4}
    # The next step, scheduled before the first one's update: the generating request decodes
    # its token in flight; the embedding request, computed whole, has nothing left.
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"g": 1}
    done = RunnerOutput(sampled_token_ids={"g": [100]}, pooled={"e": [0.5, 0.5]})
    outs = {o.request_id: o for o in sched.update(first, done)}
    assert outs["e"].finish_reason == "stop" and outs["e"].pooled == [0.5, 0.5]
    assert "e" not in sched.requests
