"""The mean output logprob the monitor reads: every sampled token's raw logprob, summed by the
engine into ``cumulative_logprob``, equal to the logprobs a request asks for, with and without
speculative decoding."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.metrics.stats import StatsCollector
from tokenmill.runner.sampler import Sampler, logprobs_of
from tokenmill.runner.sampling_metadata import SamplingMetadata

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


def test_greedy_kernel_matches_argmax_and_logsumexp() -> None:
    """The C++ greedy step (one pass per row) against torch.argmax and logprobs_of: ties take
    the first index, masked (-inf) entries weigh nothing, a NaN wins, odd vocab sizes."""
    from tokenmill.kernels.cpu import load_extension

    ext = load_extension()
    gen = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 49152), (5, 1000), (33, 17), (2, 1)]:
        logits = torch.randn(rows, vocab, generator=gen) * 5
        if vocab > 10:
            logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie
            logits[-1, ::2] = float("-inf")
        ids, lps = ext.greedy_with_logprobs(logits)
        assert torch.equal(ids, logits.argmax(-1))
        torch.testing.assert_close(lps, logprobs_of(logits, ids), rtol=1e-5, atol=1e-5)
    nan = torch.tensor([[0.0, float("nan"), 1.0], [float("-inf")] * 3])
    ids, lps = ext.greedy_with_logprobs(nan)
    assert ids.tolist() == nan.argmax(-1).tolist()
    assert torch.isnan(lps).all()
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        ext.greedy_with_logprobs(torch.zeros(4, 4, dtype=torch.float64))


def test_the_sampler_takes_the_greedy_kernel_only_without_processors() -> None:
    """Penalties change the argmax but not the raw logprob: PyTorch's path must run then."""
    from tokenmill.kernels.cpu import load_extension

    load_extension()
    logits = torch.zeros(1, 10)
    logits[0, 4] = 1.0
    plain_meta = SamplingMetadata.build([SamplingParams(temperature=0.0)], [[1]], [[]], [None],
                                        [[]])
    assert Sampler()(logits, plain_meta).sampled_token_ids.tolist() == [4]
    biased = SamplingMetadata.build([SamplingParams(temperature=0.0, logit_bias={2: 5.0})],
                                    [[1]], [[]], [None], [[]])
    out = Sampler()(logits, biased)
    assert out.sampled_token_ids.tolist() == [2]
    torch.testing.assert_close(out.chosen_logprobs, logprobs_of(logits, out.sampled_token_ids))


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
