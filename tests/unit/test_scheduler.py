"""Scheduler and block pool on their own, with a fake runner: no model, no torch."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import BlockPool, KVCacheManager
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 64, max_model_len: int = 256,
                   prefix_caching: bool = False, prefill_first: bool = True) -> Scheduler:
    """Prefix caching off unless asked: most tests here reuse one token pattern for prompts."""
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          prefill_first=prefill_first)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(cfg, kv, max_model_len)


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, **kw: object) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    prompt = [10 + (i % 50) for i in range(prompt_len)]
    return Request(rid, prompt, params, eos_token_ids=frozenset({EOS}))


def fake_run(sched: Scheduler, out: SchedulerOutput) -> RunnerOutput:
    """Sample a token for each request that caught up with its tokens: last token + 1."""
    result = RunnerOutput()
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        if req.num_computed_tokens == req.num_tokens:
            result.sampled_token_ids[rid] = [100 + req.num_output_tokens]
    return result


def run_to_end(sched: Scheduler, max_steps: int = 1000,
               run: Callable[[Scheduler, SchedulerOutput], RunnerOutput] | None = None
               ) -> dict[str, list[int]]:
    """Every request's output tokens, stepping with ``run`` (default: fake_run)."""
    run = run or fake_run
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outputs
        out = sched.schedule()
        for o in sched.update(out, run(sched, out)):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("the scheduler did not finish: it hangs")


def test_prefill_then_decode_in_one_batch() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10}
    assert [r.request_id for r in out.new_requests] == ["a"]
    sched.update(out, fake_run(sched, out))
    sched.add_request(make_request("b", 7))
    out = sched.schedule()
    # The decode of "a" and the prefill of "b" share one step.
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [c.request_id for c in out.cached_requests] == ["a"]
    assert out.cached_requests[0].num_computed_tokens == 10


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end() -> None:
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("long", 40, max_tokens=2))
    chunks, sampled_at = [], []
    for step in range(5):
        out = sched.schedule()
        chunks.append(out.num_scheduled_tokens.get("long", 0))
        run = fake_run(sched, out)
        if run.sampled_token_ids:
            sampled_at.append(step)
        sched.update(out, run)
    assert chunks == [16, 16, 8, 1, 0]
    assert sampled_at == [2, 3]


def test_budget_shared_between_running_and_waiting() -> None:
    sched = make_scheduler(budget=20)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8))
    out = sched.schedule()
    # 8 + 8 + the first 4 tokens of the third prompt.
    assert out.num_scheduled_tokens == {"r0": 8, "r1": 8, "r2": 4}
    assert out.total_num_scheduled_tokens == 20


def test_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 3))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(sched.waiting) == 2
    assert len(run_to_end(sched)) == 4


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 9 usable blocks of 4 tokens; 3 requests of 8 prompt + 8 output tokens need 12 blocks.
    sched = make_scheduler(num_blocks=10, block_size=4, budget=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=8))
    outputs = run_to_end(sched)
    assert sched.num_preemptions_total > 0
    expected = [100 + i for i in range(8)]
    assert outputs == {f"r{i}": expected for i in range(3)}
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_preempted_request_resumes_with_its_generated_tokens() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    sched.add_request(make_request("old", 4, max_tokens=12))
    sched.add_request(make_request("new", 4, max_tokens=12))
    resumed = None
    for _ in range(100):
        out = sched.schedule()
        for new in out.new_requests:
            if new.request_id == "new" and len(new.token_ids) > 4:
                resumed = new
        if out.preempted_request_ids:
            assert out.preempted_request_ids == {"new"}  # the newest goes first
        sched.update(out, fake_run(sched, out))
        if not sched.has_unfinished():
            break
    assert resumed is not None, "the preempted request was never resumed"
    assert resumed.num_computed_tokens == 0
    assert resumed.num_prompt_tokens == 4


def test_request_that_cannot_fit_is_rejected_not_hung() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(make_request("big", 10, max_tokens=20))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 64))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(make_request("empty", 0))
    sched.add_request(make_request("ok", 4, max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 4))
    assert run_to_end(sched)["ok"] == [100, 101, 102, 103]


def test_max_model_len_caps_generation() -> None:
    sched = make_scheduler(max_model_len=12)
    sched.add_request(make_request("r", 8, max_tokens=100))
    assert run_to_end(sched)["r"] == [100, 101, 102, 103]


def test_abort_between_steps_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=20)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10))
    sched.add_request(make_request("queued", 10))
    sched.config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
    out = sched.schedule()
    sched.update(out, fake_run(sched, out))
    sched.finish_requests(["a", "queued", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.running] == ["b"]
    assert not sched.waiting
    out = sched.schedule()
    assert out.finished_request_ids == {"a", "queued"}
    assert out.num_scheduled_tokens == {"b": 1}
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.usage == 0.0


def test_stop_conditions() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("tok", 4, max_tokens=10, stop_token_ids=[102]))
    sched.add_request(make_request("min", 4, max_tokens=10, min_tokens=5, stop_token_ids=[102]))
    outputs = run_to_end(sched)
    assert outputs["tok"] == [100, 101, 102]
    assert outputs["min"] == [100 + i for i in range(10)]


def test_eos_unless_ignored() -> None:
    sched = make_scheduler()
    req = make_request("r", 4, max_tokens=5)
    req.append_output_token(EOS)
    assert req.check_stop() == RequestStatus.FINISHED_STOPPED
    ignoring = make_request("i", 4, max_tokens=5, ignore_eos=True)
    ignoring.append_output_token(EOS)
    assert ignoring.check_stop() is None
    assert sched.has_unfinished() is False


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, fake_run(sched, out))
    return out


def start_decoding(sched: Scheduler, rid: str, prompt_len: int = 4, max_tokens: int = 20) -> None:
    sched.add_request(make_request(rid, prompt_len, max_tokens=max_tokens))
    assert step(sched).num_scheduled_tokens == {rid: prompt_len}


def test_prefill_first_holds_decodes_while_prompts_fill_the_step() -> None:
    sched = make_scheduler(budget=16)
    start_decoding(sched, "a")
    for rid in ("b", "c", "d"):
        sched.add_request(make_request(rid, 8))
    # Two prompts fill the budget: "a" waits one step instead of sharing two with prompts.
    assert step(sched).num_scheduled_tokens == {"b": 8, "c": 8}
    # The last prompt leaves room: the decodes take it, oldest first.
    assert step(sched).num_scheduled_tokens == {"d": 8, "a": 1, "b": 1, "c": 1}
    assert step(sched).num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 1}


def test_decodes_first_without_prefill_first() -> None:
    sched = make_scheduler(budget=16, prefill_first=False)
    start_decoding(sched, "a")
    for rid in ("b", "c", "d"):
        sched.add_request(make_request(rid, 8))
    assert step(sched).num_scheduled_tokens == {"a": 1, "b": 8, "c": 7}
    assert step(sched).num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 8}


def test_prompt_longer_than_the_budget_is_chunked_beside_the_decodes() -> None:
    sched = make_scheduler(budget=16)
    start_decoding(sched, "a")
    sched.add_request(make_request("long", 40))
    chunks = [step(sched).num_scheduled_tokens for _ in range(3)]
    assert chunks == [{"a": 1, "long": 15}] * 2 + [{"a": 1, "long": 10}]
    # A short prompt arriving meanwhile goes first, and the long one's chunk after the decodes.
    sched2 = make_scheduler(budget=16)
    start_decoding(sched2, "a")
    sched2.add_request(make_request("long", 40))
    sched2.add_request(make_request("short", 6))
    assert step(sched2).num_scheduled_tokens == {"short": 6, "a": 1, "long": 9}


def test_prefill_first_continues_a_chunked_short_prompt_before_decodes() -> None:
    sched = make_scheduler(budget=16)
    start_decoding(sched, "a")
    sched.add_request(make_request("b", 12))
    sched.add_request(make_request("c", 12))
    assert step(sched).num_scheduled_tokens == {"b": 12, "c": 4}
    # "c" is behind by 8 prompt tokens, which fit in a step: they go before "a" and "b".
    assert step(sched).num_scheduled_tokens == {"c": 8, "a": 1, "b": 1}


def test_prefill_first_does_not_hold_decodes_when_nothing_can_be_admitted() -> None:
    sched = make_scheduler(budget=16, max_num_seqs=2)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4))
    step(sched)
    sched.add_request(make_request("c", 8))
    # No room for "c" (max_num_seqs): the decodes run, nothing hangs.
    assert step(sched).num_scheduled_tokens == {"a": 1, "b": 1}
    assert len(run_to_end(sched)) == 3


def test_decode_needing_a_block_never_preempts_a_request_scheduled_this_step() -> None:
    # 6 usable blocks of 4 tokens. "a"'s 4-token prompt holds 1; "b"'s 20-token prompt takes
    # the other 5 in the prefill-first part of the step; "a"'s first decode needs a block
    # too: the newest request not scheduled yet is "a" itself, so "a" is preempted, not "b",
    # which this step already computes.
    sched = make_scheduler(num_blocks=7, block_size=4, budget=64)
    sched.add_request(make_request("a", 4, max_tokens=8))
    step(sched)
    assert sched.kv.pool.num_free_blocks == 5
    sched.add_request(make_request("b", 20, max_tokens=4))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 20}
    assert out.preempted_request_ids == {"a"}
    first = {o.request_id: o.new_token_ids for o in sched.update(out, fake_run(sched, out))}
    assert first == {"b": [100]}
    outputs = run_to_end(sched)
    # "a" resumes from its prompt and its first token, and goes on where it was.
    assert outputs == {"a": [100 + i for i in range(1, 8)], "b": [101, 102, 103]}
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


@pytest.mark.parametrize("prefill_first", [True, False])
def test_both_policies_finish_every_request_with_the_same_tokens(prefill_first: bool) -> None:
    sched = make_scheduler(num_blocks=24, block_size=4, budget=16, max_num_seqs=6,
                           prefill_first=prefill_first)
    lengths = [3, 17, 8, 40, 5, 12, 9, 30, 2, 16]
    for i, n in enumerate(lengths):
        sched.add_request(make_request(f"r{i}", n, max_tokens=6 + i % 4))
    outputs = run_to_end(sched)
    assert outputs == {f"r{i}": [100 + k for k in range(6 + i % 4)] for i in range(len(lengths))}
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_block_pool_reference_counts() -> None:
    pool = BlockPool(5)
    a = pool.allocate(2)
    assert 0 not in a and pool.num_free_blocks == 2
    pool.incref(a)
    pool.free(a)
    assert pool.num_free_blocks == 2
    pool.free(a)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.free(a)
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_kv_manager_grows_by_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    new_block_counts = []
    for num_tokens in (5, 8, 9):
        allocation = kv.allocate_slots("r", num_tokens)
        assert allocation is not None and allocation.copies == []
        new_block_counts.append(len(allocation.new_block_ids))
    assert new_block_counts == [2, 0, 1]
    assert kv.allocate_slots("other", 100) is None
    assert "other" not in kv.req_blocks
    kv.free("r")
    assert kv.usage == 0.0
