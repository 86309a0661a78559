"""The scheduler's side of speculative decoding, with a fake runner: no model, no torch."""

from __future__ import annotations

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request
from tokenmill.runner.rejection import greedy_accept
from tokenmill.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), max_model_len=256)


def make_request(rid: str, prompt_len: int, max_tokens: int = 16, **kw: object) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Request(rid, list(range(10, 10 + prompt_len)), params, eos_token_ids=frozenset({EOS}))


def truth(index: int) -> int:
    """The token the fake target model puts at sequence index ``index``."""
    return 100 + index


def fake_run(sched: Scheduler, out: SchedulerOutput) -> RunnerOutput:
    """Greedy verification against ``truth``; plain sampling for requests without drafts."""
    result = RunnerOutput()
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        if req.num_computed_tokens == req.num_tokens + len(drafts):
            targets = [truth(req.num_tokens + j) for j in range(len(drafts) + 1)]
            result.sampled_token_ids[rid] = greedy_accept(targets, drafts)
    return result


def step(sched: Scheduler) -> tuple[SchedulerOutput, dict[str, list[int]]]:
    out = sched.schedule()
    news = {o.request_id: o.new_token_ids for o in sched.update(out, fake_run(sched, out))}
    return out, news


def test_drafts_are_scheduled_verified_and_rolled_back() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 6))
    step(sched)  # prefill + the first token (index 6)
    req = sched.requests["a"]
    assert req.num_tokens == 7 and req.num_computed_tokens == 6
    # Drafts for indices 7, 8, 9: the first right, the second wrong.
    sched.set_draft_tokens({"a": [truth(7), 0, truth(9)]})
    out, news = step(sched)
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [truth(7), 0, truth(9)]}
    assert len(sched.kv.get_block_ids("a")) == 3  # room for 6 + 4 tokens was made
    assert news == {"a": [truth(7), truth(8)]}
    # The last token and the accepted draft are computed; the two rejected ones are not.
    assert req.num_tokens == 9 and req.num_computed_tokens == 8
    assert not req.spec_token_ids
    out, news = step(sched)  # no drafts: one token
    assert out.num_scheduled_tokens == {"a": 1} and news == {"a": [truth(9)]}


def test_drafts_are_cut_to_the_budget_and_the_length_limit() -> None:
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 4, max_tokens=6))
    sched.add_request(make_request("b", 4))
    step(sched)
    sched.set_draft_tokens({"a": [truth(5 + i) for i in range(8)], "b": [truth(5)] * 8})
    # "a" has 1 output token of 6: 5 more at most, so 4 drafts + 1.
    assert sched.requests["a"].spec_token_ids == [truth(5 + i) for i in range(4)]
    out, news = step(sched)
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}  # "b" gets what is left of the budget
    assert news["a"] == [truth(5 + i) for i in range(5)]
    assert "a" not in sched.requests  # finished at max_tokens exactly


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, stop_token_ids=[truth(6)]))
    step(sched)
    sched.set_draft_tokens({"a": [truth(5), truth(6), truth(7)]})
    _, news = step(sched)
    assert news == {"a": [truth(5), truth(6)]}
    assert "a" not in sched.requests and sched.kv.usage == 0.0


def test_drafts_never_preempt_and_preemption_drops_them() -> None:
    # 3 usable blocks of 4 tokens: "a" holds 2 (7 + 1 tokens), "b" holds 1 (2 + 1 tokens).
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", 7, max_tokens=4))
    sched.add_request(make_request("b", 2, max_tokens=4))
    step(sched)
    sched.set_draft_tokens({"a": [truth(8), truth(9), truth(10)]})  # would need a 3rd block
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not out.scheduled_spec_decode_tokens and not out.preempted_request_ids
    # Now "a" needs its third block for real: "b", the newest, is preempted with its drafts.
    sched.set_draft_tokens({"b": [truth(4)]})
    out, _ = step(sched)
    assert out.preempted_request_ids == {"b"}
    assert sched.requests["b"].spec_token_ids == []
    assert sched.requests["b"].num_computed_tokens == 0
