"""The scheduler's priority order (vLLM's priority policy): waiting requests by (priority,
arrival), and a more urgent request that cannot start preempts the least urgent running one."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))

from test_scheduler import fake_run, make_request, make_scheduler, run_to_end  # noqa: E402


def test_waiting_requests_start_by_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for rid, prio in [("low-a", 5), ("high", -1), ("low-b", 5), ("mid", 0)]:
        sched.add_request(make_request(rid, 4, max_tokens=2, priority=prio))
    started: list[str] = []
    for _ in range(50):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        started += [n.request_id for n in out.new_requests]
        sched.update(out, fake_run(sched, out))
    assert started == ["high", "mid", "low-a", "low-b"]


def test_equal_priorities_keep_arrival_order() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for rid in ["a", "b", "c"]:
        sched.add_request(make_request(rid, 4, max_tokens=1))
    out = sched.schedule()
    assert [n.request_id for n in out.new_requests] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_urgent_request_preempts_the_least_urgent_running_one() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for rid in ["low-1", "low-2"]:
        sched.add_request(make_request(rid, 4, max_tokens=20, priority=10))
    out = sched.schedule()
    sched.update(out, fake_run(sched, out))
    sched.add_request(make_request("urgent", 4, max_tokens=3, priority=0))
    out = sched.schedule()
    # The newest of the least urgent gives its place up; the urgent one starts next step.
    assert out.preempted_request_ids == {"low-2"}
    sched.update(out, fake_run(sched, out))
    out = sched.schedule()
    assert [n.request_id for n in out.new_requests] == ["urgent"]
    sched.update(out, fake_run(sched, out))
    # Everyone still finishes, the preempted request with all its tokens.
    outputs = run_to_end(sched)
    assert len(outputs["low-2"]) > 0 and not sched.has_unfinished()


def test_no_preemption_for_an_equal_or_less_urgent_request() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("first", 4, max_tokens=5, priority=0))
    out = sched.schedule()
    sched.update(out, fake_run(sched, out))
    sched.add_request(make_request("same", 4, max_tokens=1, priority=0))
    sched.add_request(make_request("later", 4, max_tokens=1, priority=3))
    out = sched.schedule()
    assert not out.preempted_request_ids and not out.new_requests
