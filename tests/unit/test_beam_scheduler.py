"""Beam search in the scheduler with a fake runner (no model): its ranking step on its own,
and whole searches that must end with the same hypotheses however tight the batch places,
the KV blocks and the token budget are."""

from __future__ import annotations

import random

import pytest
from test_scheduler import run_to_end as run_scheduler

from tokenmill.config import SchedulerConfig
from tokenmill.core.beam_search import BeamGroup, beam_search_request
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.outputs import TokenLogprobs
from tokenmill.request import BeamSpec, Request
from tokenmill.sampling_params import SamplingParams

EOS = 2
VOCAB = 48


def fake_logprobs(token_ids: list[int]) -> list[float]:
    """A made-up next-token distribution that depends only on the sequence so far."""
    rng = random.Random(hash(tuple(token_ids)))
    return [-rng.uniform(0.5, 6.0) for _ in range(VOCAB)]


def fake_run(sched: Scheduler, out: SchedulerOutput) -> RunnerOutput:
    result = RunnerOutput()
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        if req.num_computed_tokens != req.num_tokens:
            continue  # a prompt chunk
        lps = fake_logprobs(req.all_token_ids)
        ranked = sorted(range(VOCAB), key=lambda t: -lps[t])
        best = ranked[0]
        result.sampled_token_ids[rid] = [best]
        k = req.sampling_params.logprobs or 0
        result.logprobs[rid] = [TokenLogprobs(best, lps[best], 1,
                                              {t: lps[t] for t in ranked[:k]})]
    return result


def run_to_end(sched: Scheduler) -> dict[str, list[int]]:
    return run_scheduler(sched, 2000, fake_run)


def make_scheduler(num_blocks: int = 256, max_num_seqs: int = 16, budget: int = 64,
                   prefix_caching: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4, enable_prefix_caching=prefix_caching),
                     max_model_len=256)


def beam_request(rid: str, prompt: list[int], n: int, max_tokens: int,
                 **kw: object) -> Request:
    params = SamplingParams(n=n, use_beam_search=True, max_tokens=max_tokens,
                            **kw)  # type: ignore[arg-type]
    return beam_search_request(rid, prompt, params, frozenset({EOS}), VOCAB, 0.0)


def add_workload(sched: Scheduler) -> None:
    sched.add_request(beam_request("a", [5, 6, 7, 8, 9, 10, 11], 4, 12))
    sched.add_request(Request("g", [20, 21, 22], SamplingParams(temperature=0, max_tokens=2),
                              eos_token_ids=frozenset({EOS})))
    sched.add_request(beam_request("b", [30, 31, 32, 33, 34], 3, 14, length_penalty=0.0))
    sched.add_request(beam_request("c", [40, 41], 2, 9, early_stopping=True))


@pytest.mark.parametrize("options", [
    dict(num_blocks=20),  # each group fits alone, not all at once
    dict(max_num_seqs=4),
    dict(max_num_seqs=4, num_blocks=21),
    dict(budget=5),  # prompts in chunks; groups split over steps
    dict(prefix_caching=False, num_blocks=22),
], ids=["few-blocks", "few-seqs", "few-both", "small-budget", "no-cache"])
def test_tight_scheduling_ends_with_the_same_hypotheses(options: dict) -> None:
    roomy = make_scheduler()
    add_workload(roomy)
    expected = run_to_end(roomy)
    assert sorted(expected) == ["a#0", "a#1", "a#2", "a#3", "b#0", "b#1", "b#2", "c#0",
                                "c#1", "g"]
    tight = make_scheduler(**options)
    add_workload(tight)
    assert run_to_end(tight) == expected
    assert tight.kv.pool.num_free_blocks == tight.kv.pool.num_usable_blocks
    assert not tight.requests and not tight.beams.groups and not tight.beams.unseen
    assert not tight.beams.group_of


def group(n: int = 2, **kw: object) -> BeamGroup:
    g = BeamGroup(BeamSpec(tuple(f"r#{i}" for i in range(n)), kw.pop("length_penalty", 1.0),
                           kw.pop("early_stopping", False), frozenset({EOS})))
    root = Request("r#0", [7, 8], SamplingParams(max_tokens=10), max_total_tokens=12)
    g.start(root)
    return g


def test_an_ending_token_outside_the_top_n_is_no_hypothesis() -> None:
    g = group(2)
    # Top 4: 5, 6, eos (rank 3: beyond n = 2), 9.
    g.report(g.live[0], {5: -0.1, 6: -0.2, EOS: -0.3, 9: -0.4})
    selection = g.select()
    assert [c.token_id for c in selection.beams] == [5, 6]
    assert g.finished == [] and not selection.done


def test_an_ending_token_in_the_top_n_finishes_a_hypothesis() -> None:
    g = group(2)
    g.report(g.live[0], {EOS: -0.1, 6: -0.2, 5: -0.3, 9: -0.4})
    selection = g.select()
    assert [c.token_id for c in selection.beams] == [6, 5]  # the ended one does not go on
    assert [(h.token_ids, h.finish_reason) for h in g.finished] == [([EOS], "stop")]
    assert g.finished[0].score == pytest.approx(-0.1)


def test_early_stopping_true_ends_when_n_hypotheses_are_finished() -> None:
    g = group(1, early_stopping=True)
    g.report(g.live[0], {EOS: -0.1, 6: -0.2})
    assert g.select().done


def test_the_heuristic_ends_when_no_beam_can_beat_the_finished() -> None:
    g = group(1, length_penalty=1.0)
    g.report(g.live[0], {EOS: -0.1, 6: -0.2})
    selection = g.select()
    # One finished hypothesis (score -0.1); the live beam's best at length 1 is -0.2.
    assert selection.done and not g.improvable


def test_a_longer_beam_may_still_win_with_a_length_penalty() -> None:
    g = group(1, length_penalty=2.0, early_stopping="never")
    g.report(g.live[0], {EOS: -1.0, 6: -1.1})
    # "never" with a positive penalty bounds the live beam at the length limit: -1.1 / 10**2
    # beats -1.0.
    assert not g.select().done


def test_groups_that_wait_for_each_others_places_go_on() -> None:
    """Two groups split over the batch's places, each with beams that have run holding
    places while its other beams wait: those that have run give their places up."""
    expected = {}
    for max_num_seqs in (16, 4):
        sched = make_scheduler(max_num_seqs=max_num_seqs)
        sched.add_request(beam_request("a", [5, 6, 7, 8, 9, 10, 11], 4, 12))
        sched.add_request(Request("g", [20, 21, 22], SamplingParams(temperature=0,
                                                                    max_tokens=1)))
        sched.add_request(beam_request("c", [40, 41], 3, 9))
        expected[max_num_seqs] = run_to_end(sched)
    assert expected[4] == expected[16]


@pytest.mark.parametrize("num_blocks", [21, 24, 27])
def test_groups_that_wait_for_each_others_blocks_go_on(num_blocks: int) -> None:
    """The same with KV blocks: each group fits alone, both do not (preemption then picks
    beams that have run, or releases them for a waiting one)."""
    expected = {}
    for blocks in (256, num_blocks):
        sched = make_scheduler(num_blocks=blocks, prefix_caching=False)
        sched.add_request(beam_request("a", [5, 6, 7, 8, 9, 10, 11], 4, 12,
                                       ignore_eos=True))
        sched.add_request(beam_request("c", [40, 41, 42, 43, 44, 45], 4, 12,
                                       ignore_eos=True))
        expected[blocks] = run_to_end(sched)
    assert expected[num_blocks] == expected[256]
