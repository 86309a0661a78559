"""The mean output logprob the monitor reads: every sampled token's raw logprob, summed by the
engine into ``cumulative_logprob``, equal to the logprobs a request asks for, with and without
speculative decoding."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.metrics.stats import StatsCollector
from tokenmill.runner.sampler import Sampler, SamplingMetadata, logprobs_of

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5, 6, 7,", "Roses are red, violets are"]
COMMON = dict(dtype="float32", quantization="none", max_model_len=256,
              kv_cache_memory_bytes=32 << 20)


def test_logprobs_of_is_the_log_softmax_entry() -> None:
    logits = torch.randn(5, 100)
    ids = torch.tensor([3, 99, 0, 50, 7])
    expected = torch.log_softmax(logits, -1).gather(1, ids.view(-1, 1)).squeeze(1)
    torch.testing.assert_close(logprobs_of(logits, ids), expected)


def test_the_sampler_gives_chosen_logprobs_unless_told_not_to() -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0)] * 3
    meta = SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, [None] * 3, [[]] * 3)
    out = Sampler()(logits, meta)
    torch.testing.assert_close(out.chosen_logprobs,
                               logprobs_of(logits, out.sampled_token_ids))
    assert Sampler(chosen_logprobs=False)(logits, meta).chosen_logprobs is None


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**COMMON)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def ngram() -> LLM:
    return LLM(**COMMON, speculative="ngram", num_speculative_tokens=4)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ["plain", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cumulative_logprob_is_the_sum_of_the_token_logprobs(
        request: pytest.FixtureRequest, engine: str, temperature: float) -> None:
    llm: LLM = request.getfixturevalue(engine)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=24, ignore_eos=True)
    asked = llm.generate(PROMPTS, SamplingParams(temperature=temperature, seed=3, max_tokens=24,
                                                 ignore_eos=True, logprobs=0))
    silent = llm.generate(PROMPTS, params)
    for a, s in zip(asked, silent, strict=True):
        total = sum(lp.logprob for lp in a.outputs[0].logprobs)
        assert a.outputs[0].cumulative_logprob == pytest.approx(total, abs=1e-3)
        if s.outputs[0].token_ids == a.outputs[0].token_ids:
            assert s.outputs[0].cumulative_logprob == pytest.approx(total, abs=1e-3)
        assert total < 0 and math.isfinite(total)


def test_finished_stats_carry_the_mean_logprob_prompt_and_stop(plain: LLM) -> None:
    from tokenmill.engine.output_processor import OutputKind

    engine = plain.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[","])
    engine.add_request("r", "1, 2, 3, 4, 5, 6, 7,", params, kind=OutputKind.DELTA)
    collector = StatsCollector()
    finished = []
    while engine.has_unfinished_requests():
        finished += collector.observe(engine.step()).finished
    (f,) = finished
    assert f.prompt == "1, 2, 3, 4, 5, 6, 7,"
    assert f.finish_reason == "stop" and f.stop_reason == ","
    assert f.mean_logprob is not None and f.mean_logprob < 0
