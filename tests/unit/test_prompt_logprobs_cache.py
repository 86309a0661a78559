"""A request that wants prompt logprobs only from ``prompt_logprobs_start`` on may start from
the prefix cache, up to the token whose logits score the first one it wants (fake runner)."""

from __future__ import annotations

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.sched_output import RunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

PROMPT = list(range(10, 30))  # 20 tokens: five blocks of 4


def _run_alone(sched: Scheduler, request: Request) -> int:
    """Run ``request`` to its end; the tokens its first step found in the cache."""
    sched.add_request(request)
    first = None
    while sched.has_unfinished():
        out = sched.schedule()
        if first is None:
            [new] = out.new_requests
            first = new.num_computed_tokens
        runner = RunnerOutput()
        for rid in out.num_scheduled_tokens:
            r = sched.requests[rid]
            if r.num_computed_tokens == r.num_tokens:
                runner.sampled_token_ids[rid] = [7]
        sched.update(out, runner)
    assert first is not None
    return first


@pytest.mark.parametrize(("start", "cached"), [
    (0, 0), (1, 0), (2, 0), (5, 4), (9, 8), (12, 8), (13, 12), (20, 16), (10_000, 16)])
def test_cache_serves_the_tokens_before_the_first_scored_one(start: int, cached: int) -> None:
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, 256)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    assert _run_alone(sched, Request("warm", PROMPT, params, frozenset())) == 0
    queries, hits = kv.prefix_stats.queries, kv.prefix_stats.hits
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                            prompt_logprobs_start=start)
    assert _run_alone(sched, Request("scored", PROMPT, scored, frozenset())) == cached
    assert kv.prefix_stats.hits - hits == cached
    # A request that wants every prompt logprob is not counted as a lookup at all.
    assert kv.prefix_stats.queries - queries == (0 if start <= 1 else len(PROMPT))


def test_prompt_logprobs_start_is_validated() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=1.5)  # type: ignore[arg-type]
