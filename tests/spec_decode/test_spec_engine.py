"""Speculative decoding on the embedded SmolLM2 (fp32, unquantized): greedy output identical
to plain decoding for both proposers, in mixed batches, under preemption and at stop
conditions inside an accepted run; seeded sampling reproducible; metrics."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.output_processor import OutputKind
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.metrics.stats import IterationStats

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9,",
    f"{CODE}\n# The same two functions again:\n",
    "The capital of France is",
    "Roses are red, violets are blue, roses are red, violets are",
]
COMMON = dict(dtype="float32", quantization="none", max_model_len=512,
              kv_cache_memory_bytes=64 << 20)


def greedy(max_tokens: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          **kw)  # type: ignore[arg-type]


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**COMMON)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def ngram() -> LLM:
    return LLM(**COMMON, speculative="ngram", num_speculative_tokens=4)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def self_draft() -> LLM:
    return LLM(**COMMON, speculative_model="self:8",  # type: ignore[arg-type]
               num_speculative_tokens=3)


@pytest.mark.parametrize("proposer", ["ngram", "self_draft"])
def test_greedy_output_is_identical(request: pytest.FixtureRequest, plain: LLM,
                                    proposer: str) -> None:
    spec: LLM = request.getfixturevalue(proposer)
    stats = spec.engine.core.spec_stats
    assert stats is not None
    before = stats.num_accepted_tokens
    assert tokens(spec.generate(PROMPTS, greedy())) == tokens(plain.generate(PROMPTS, greedy()))
    assert stats.num_accepted_tokens > before
    assert 1.0 <= stats.mean_acceptance_length <= 5.0
    assert 0.0 < stats.acceptance_rate <= 1.0


def test_mixed_batch_with_opted_out_and_sampled_requests(plain: LLM, ngram: LLM) -> None:
    params = [greedy(), greedy(speculative=False), greedy(20),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=3)]
    got = ngram.generate(PROMPTS, params)
    want = plain.generate(PROMPTS, params)
    assert tokens(got)[:3] == tokens(want)[:3]
    assert len(got[3].outputs[0].token_ids) == 24
    stats = ngram.engine.core.spec_stats
    assert stats is not None
    drafts = stats.num_drafts
    ngram.generate(PROMPTS, greedy(16, speculative=False))
    assert stats.num_drafts == drafts  # nobody speculated


@pytest.mark.parametrize("spec", [dict(speculative="ngram", num_speculative_tokens=4),
                                  dict(speculative_model="self:8", num_speculative_tokens=3)],
                         ids=["ngram", "self-draft"])
def test_preemption_keeps_greedy_output(plain: LLM, spec: dict) -> None:
    prompts = PROMPTS * 2
    params = greedy(48)
    # 8 requests of up to ~70 tokens; 16 blocks of 16 tokens hold ~3 of them.
    small = LLM(dtype="float32", quantization="none", max_model_len=256, num_kv_blocks=16,
                max_num_batched_tokens=128, **spec)  # type: ignore[arg-type]
    assert tokens(small.generate(prompts, params)) == tokens(plain.generate(prompts, params))
    core = small.engine.core
    assert core.scheduler.num_preemptions_total > 0
    assert core.spec_stats is not None and core.spec_stats.num_accepted_tokens > 0
    assert core.scheduler.kv.usage == 0.0


def _steps(llm: LLM, prompt: str, params: SamplingParams) -> list[list[int]]:
    """The tokens each engine step delivered."""
    engine = llm.engine
    engine.add_request("steps", prompt, params, kind=OutputKind.DELTA)
    steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids:
                steps.append(out.outputs[0].token_ids)
    return steps


def test_stops_inside_an_accepted_run(plain: LLM, ngram: LLM) -> None:
    prompt = PROMPTS[1]
    full = plain.generate(prompt, greedy(40))[0].outputs[0]
    ids = full.token_ids
    tok = plain.get_tokenizer()
    # Output indices that came in the middle of a multi-token step.
    inside, n = [], 0
    for step in _steps(ngram, prompt, greedy(40)):
        inside += list(range(n, n + len(step) - 1))
        n += len(step)
    assert len(inside) > 5, "prompt lookup accepted too little to test this"
    checked = 0
    for m in inside:
        text_to_m = tok.decode(ids[:m + 1])
        stop = text_to_m[-3:]
        if len(stop.strip()) < 2 or full.text.find(stop) + len(stop) != len(text_to_m):
            continue  # the stop string must first complete at token m
        for params in (greedy(40, stop=[stop]), greedy(40, stop_token_ids=[ids[m]]),
                       greedy(m + 1)):
            got, want = ngram.generate(prompt, params)[0], plain.generate(prompt, params)[0]
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.outputs[0].text == want.outputs[0].text
            assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
        checked += 1
    assert checked >= 2


def test_logprobs_match(plain: LLM, ngram: LLM) -> None:
    params = greedy(24, logprobs=3)
    got, want = ngram.generate(PROMPTS[0], params)[0], plain.generate(PROMPTS[0], params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].logprobs is not None and want.outputs[0].logprobs is not None
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert a.token_id == b.token_id and a.rank == b.rank and list(a.top) == list(b.top)
        assert abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize("proposer", ["ngram", "self_draft"])
def test_seeded_sampling_is_reproducible(request: pytest.FixtureRequest, proposer: str) -> None:
    spec: LLM = request.getfixturevalue(proposer)

    def sample(seed: int, batch: bool = False) -> list[int]:
        p = SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.1, max_tokens=32,
                           seed=seed)
        if not batch:
            return spec.generate(PROMPTS[1], p)[0].outputs[0].token_ids
        mates = SamplingParams(temperature=1.0, max_tokens=40)
        return spec.generate(PROMPTS, [mates, p, mates, mates])[1].outputs[0].token_ids

    first = sample(7)
    assert sample(7) == first
    assert sample(7, batch=True) == first
    assert sample(8) != first


def test_metrics_reach_prometheus(ngram: LLM) -> None:
    ngram.generate(PROMPTS[0], greedy(16))
    core = ngram.engine.core
    logger = PrometheusStatLogger("m")
    logger.record(core.stats(), IterationStats())
    text = logger.render()[0].decode()
    stats = core.spec_stats
    assert stats is not None
    assert (f'tokenmill:spec_decode_num_draft_tokens_total{{model_name="m"}} '
            f"{float(stats.num_draft_tokens)}") in text
    assert (f'tokenmill:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f"{float(stats.num_accepted_tokens)}") in text
    assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="speculative method"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig("ngram", ngram_min=5, ngram_max=3)
    with pytest.raises(ValueError, match="speculative_model"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="speculative_model"):
        SpeculativeConfig.from_options(speculative_model="self:x")
    assert SpeculativeConfig.from_options(speculative_model="self:4").method == "draft"
    with pytest.raises(ValueError, match="fewer layers"):
        LLM(**COMMON, speculative_model="self:30")  # type: ignore[arg-type]


def test_draft_model_loaded_from_a_path(plain: LLM, smollm_path: str) -> None:
    """A draft from a model file (here the target's own GGUF: same tokenizer, and a draft that
    agrees with the target on nearly every token)."""
    spec = LLM(**COMMON, speculative_model=smollm_path,  # type: ignore[arg-type]
               num_speculative_tokens=3)
    assert tokens(spec.generate(PROMPTS[:2], greedy(24))) == tokens(
        plain.generate(PROMPTS[:2], greedy(24)))
    stats = spec.engine.core.spec_stats
    assert stats is not None
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
