"""Sampler: seeds, greedy, top-k/top-p/min-p, penalties, logit bias, min_tokens, logprobs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from tokenmill.runner.sampler import (
    Sampler,
    apply_logits_processors,
    compute_prompt_logprobs,
    gather_logprobs,
    plain_greedy,
)
from tokenmill.runner.sampling_metadata import SamplingMetadata
from tokenmill.sampling_params import SamplingParams

V = 64


def build(params: Sequence[SamplingParams], *, prompts: Sequence[Sequence[int]] | None = None,
          outputs: Sequence[Sequence[int]] | None = None,
          generators: Sequence[torch.Generator | None] | None = None,
          stops: Sequence[Sequence[int]] | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts if prompts is not None else [[]] * n,
        output_token_ids=outputs if outputs is not None else [[]] * n,
        generators=generators if generators is not None else [None] * n,
        stop_token_ids=stops if stops is not None else [[]] * n,
    )


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], **kw: object) -> list[int]:
    return Sampler()(logits, build(params, **kw)).sampled_token_ids.tolist()  # type: ignore[arg-type]


def gen(seed: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, V, generator=gen(1234)) * 2


# ---------------------------------------------------------------- seeds


@pytest.mark.parametrize("extra", [{}, {"top_k": 10}, {"top_p": 0.9}, {"min_p": 0.05},
                                   {"top_k": 20, "top_p": 0.8, "temperature": 0.7}])
def test_seeded_sampling_independent_of_batch(logits: torch.Tensor, extra: dict) -> None:
    target = SamplingParams(**{"seed": 42, "temperature": 1.5, **extra})
    row = logits[0:1]
    # Alone, ten steps.
    g = gen(42)
    alone = [sample(row, [target], generators=[g])[0] for _ in range(10)]
    # At row 3 among seeded, unseeded and greedy mates, ten steps.
    mates = [SamplingParams(seed=7), SamplingParams(), SamplingParams(temperature=0.0)]
    g = gen(42)
    mate_gens = [gen(7), None, None]
    batch = torch.cat([logits[1:4], row, logits[4:6]])
    batched = []
    for _ in range(10):
        out = sample(batch, [*mates, target, SamplingParams(top_p=0.5), SamplingParams(seed=1)],
                     generators=[*mate_gens, g, None, gen(1)])
        batched.append(out[3])
    assert alone == batched
    assert len(set(alone)) > 1  # temperature 1.5 on random logits: the draws do vary


def test_different_seeds_differ(logits: torch.Tensor) -> None:
    row = logits[0:1]
    runs = []
    for seed in (1, 2):
        g = gen(seed)
        runs.append([sample(row, [SamplingParams(seed=seed, temperature=2.0)],
                            generators=[g])[0] for _ in range(20)])
    assert runs[0] != runs[1]


def test_seeded_draws_follow_distribution() -> None:
    # 4000 rows, each with its own seed, one draw each: the histogram must match softmax.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    params = [SamplingParams(seed=i) for i in range(n)]
    counts = Counter(sample(logits, params, generators=[gen(i) for i in range(n)]))
    for tok, p in enumerate(probs.tolist()):
        assert abs(counts[tok] / n - p) < 0.03, (tok, counts)


# ---------------------------------------------------------------- greedy


def test_temperature_zero_and_top_k_one_are_argmax(logits: torch.Tensor) -> None:
    want = logits.argmax(dim=-1).tolist()
    assert sample(logits, [SamplingParams(temperature=0.0)] * 6) == want
    assert sample(logits, [SamplingParams(top_k=1, temperature=1.7)] * 6) == want
    seeded = [SamplingParams(top_k=1, seed=i) for i in range(6)]
    assert sample(logits, seeded, generators=[gen(i) for i in range(6)]) == want


def test_mixed_batch_greedy_rows(logits: torch.Tensor) -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)] * 3
    meta = build(params)
    assert not meta.all_greedy and not meta.all_random and meta.greedy_mask is not None
    want = logits.argmax(dim=-1).tolist()
    for _ in range(5):
        got = Sampler()(logits, meta).sampled_token_ids.tolist()
        assert got[0::2] == want[0::2]


@pytest.mark.parametrize(("extra", "plain"), [
    ({}, True), ({"top_k": 1, "temperature": 0.8}, True), ({"temperature": 0.7}, False),
    ({"logprobs": 0}, False), ({"logit_bias": {3: 5.0}}, False), ({"min_tokens": 2}, False),
    ({"presence_penalty": 0.5}, False), ({"frequency_penalty": 0.5}, False),
    ({"repetition_penalty": 1.2}, False)])
def test_plain_greedy_rows_take_the_metadata_free_path(logits: torch.Tensor, extra: dict,
                                                      plain: bool) -> None:
    """Sampler.greedy gives __call__'s ids and chosen logprobs, for exactly the rows that ask
    nothing but the argmax."""
    params = SamplingParams(**{"temperature": 0.0, **extra})
    from tokenmill.kernels.cpu import extension_or_none

    assert plain_greedy(params) is plain
    if not plain:
        return
    if extension_or_none() is None:
        pytest.skip("tokenmill's C++ extension cannot be built here: no greedy kernel")
    fast, full = Sampler().greedy(logits), Sampler()(logits, build([params] * 6))
    assert fast is not None
    assert torch.equal(fast.sampled_token_ids, full.sampled_token_ids)
    assert torch.equal(fast.chosen_logprobs, full.chosen_logprobs)
    assert fast.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert Sampler(chosen_logprobs=False).greedy(logits) is None


def test_metadata_skips_unused_features() -> None:
    meta = build([SamplingParams(temperature=0.0)] * 3)
    assert meta.all_greedy and not meta.all_random and meta.no_penalties
    assert meta.temperature is None and meta.top_k is None and meta.top_p is None
    assert meta.min_p is None and meta.logit_bias is None and meta.min_tokens_mask is None
    assert meta.output_tokens is None and meta.max_num_logprobs is None
    meta = build([SamplingParams(), SamplingParams(top_k=5)])
    assert meta.all_random and meta.top_k is not None and meta.top_p is None
    # Seeds of greedy rows are not needed: greedy rows draw nothing.
    meta = build([SamplingParams(temperature=0.0, seed=1), SamplingParams(seed=2)],
                 generators=[gen(1), gen(2)])
    assert list(meta.generators) == [1]


# ---------------------------------------------------------------- filters (empirical)

PROBS = torch.tensor([0.04, 0.5, 0.06, 0.25, 0.15])  # sorted: 1, 3, 4, 2, 0


def draw_many(params: SamplingParams, n: int = 3000) -> Counter[int]:
    logits = PROBS.log().expand(n, len(PROBS)).contiguous()
    return Counter(sample(logits, [params] * n))


@pytest.mark.parametrize(("params", "allowed"), [
    (SamplingParams(top_k=2), {1, 3}),
    (SamplingParams(top_k=3), {1, 3, 4}),
    (SamplingParams(top_p=0.7), {1, 3}),
    (SamplingParams(top_p=0.8), {1, 3, 4}),
    (SamplingParams(top_p=0.4), {1}),
    (SamplingParams(min_p=0.2), {1, 3, 4}),
    (SamplingParams(min_p=0.45), {1, 3}),
    (SamplingParams(top_k=3, top_p=0.7), {1, 3}),
    (SamplingParams(top_k=2, top_p=0.95), {1, 3}),
    (SamplingParams(top_k=4, min_p=0.25), {1, 3, 4}),
    (SamplingParams(top_k=100), {0, 1, 2, 3, 4}),  # k larger than the vocabulary
    (SamplingParams(), {0, 1, 2, 3, 4}),
])
def test_filters_leave_only_allowed_tokens(params: SamplingParams, allowed: set[int]) -> None:
    counts = draw_many(params)
    assert set(counts) == allowed
    # The kept tokens keep their relative probabilities.
    kept = PROBS[sorted(allowed)]
    for tok, p in zip(sorted(allowed), (kept / kept.sum()).tolist(), strict=True):
        assert abs(counts[tok] / 3000 - p) < 0.04, (tok, counts)


def test_top_k_per_row_in_one_batch() -> None:
    n = 1000
    logits = PROBS.log().expand(3 * n, len(PROBS)).contiguous()
    params = [SamplingParams(top_k=1 + i % 2 * 2, temperature=1.0 + i % 2) for i in range(n)]
    params = params + [SamplingParams()] * n + [SamplingParams(top_k=2)] * n
    out = sample(logits, params)
    assert set(out[:n:2]) == {1}  # top_k=1 rows are greedy
    assert set(out[1:n:2]) == {1, 3, 4}
    assert set(out[n:2 * n]) == {0, 1, 2, 3, 4}
    assert set(out[2 * n:]) == {1, 3}


def test_low_temperature_sharpens() -> None:
    counts = draw_many(SamplingParams(temperature=0.05))
    assert counts[1] == 3000


# ---------------------------------------------------------------- penalties, bias, min_tokens


def test_penalties_match_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.9],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 0.9]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25, temperature=0.0), SamplingParams()]
    meta = build(params, prompts=[[0, 1], [0, 1, 2, 3]], outputs=[[3, 3, 4], [5, 5]])
    out = apply_logits_processors(logits, meta)
    # repetition over prompt+output {0,1,3,4}: 2/2, -1*2, 3/2, -2*2; then output-only
    # frequency*count + presence: token 3 (count 2): 1.5-1.0-0.25, token 4 (count 1): -4-0.75.
    want = torch.tensor([1.0, -2.0, 0.5, 0.25, -4.75, 0.9])
    torch.testing.assert_close(out[0], want)
    torch.testing.assert_close(out[1], logits[1])  # the row without penalties is untouched
    assert logits[0, 3] == 3.0  # input not modified
    assert sample(logits, params, prompts=[[0, 1], []], outputs=[[3, 3, 4], []])[0] == 0


def test_repetition_penalty_only_prompt_tokens() -> None:
    logits = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    meta = build([SamplingParams(repetition_penalty=0.5)], prompts=[[0, 2]], outputs=[[]])
    assert meta.prompt_tokens is not None
    out = apply_logits_processors(logits, meta)
    torch.testing.assert_close(out[0], torch.tensor([2.0, 1.0, -0.5, -1.0]))


def test_frequency_penalty_ignores_prompt() -> None:
    logits = torch.zeros(1, 4)
    meta = build([SamplingParams(frequency_penalty=1.0, presence_penalty=-0.5)],
                 prompts=[[0, 0, 1]], outputs=[[2, 2, 2, 1]])
    assert meta.prompt_tokens is None  # no repetition penalty: the prompt is not needed
    out = apply_logits_processors(logits, meta)
    torch.testing.assert_close(out[0], torch.tensor([0.0, -0.5, -2.5, 0.0]))


def test_logit_bias_forces_and_bans(logits: torch.Tensor) -> None:
    params = [SamplingParams(logit_bias={7: 100.0}, temperature=2.0)] * 6
    assert sample(logits, params) == [7] * 6
    top = logits.argmax(dim=-1).tolist()
    banned = [SamplingParams(temperature=0.0, logit_bias={t: -100.0}) for t in top]
    got = sample(logits, banned)
    assert all(g != t for g, t in zip(got, top, strict=True))
    assert got == [row.topk(2).indices[1].item() for row in logits]


def test_min_tokens_suppresses_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 8)
    logits[:, 5] = 10.0  # eos is the argmax
    logits[:, 6] = 9.0  # a stop_token_id
    logits[:, 2] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6])
    stops = [[5, 6]] * 3
    got = sample(logits, [p, p, SamplingParams(temperature=0.0)],
                 outputs=[[1, 1], [1, 1, 1], []], stops=stops)
    assert got == [2, 5, 5]


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_raw_logits(logits: torch.Tensor) -> None:
    params = [SamplingParams(logprobs=3, temperature=0.3, repetition_penalty=1.5,
                             logit_bias={0: 5.0}),
              SamplingParams(logprobs=5, top_k=4), SamplingParams(), SamplingParams(logprobs=0),
              SamplingParams(temperature=0.0, logprobs=1), SamplingParams(seed=3)]
    meta = build(params, prompts=[[1, 2]] * 6, outputs=[[3]] * 6,
                 generators=[None] * 5 + [gen(3)])
    assert meta.max_num_logprobs == 5
    out = Sampler()(logits, meta)
    ref = torch.log_softmax(logits, dim=-1)
    ids = out.sampled_token_ids
    assert out.has_logprobs and out.topk_logprobs is not None and out.topk_token_ids is not None
    torch.testing.assert_close(out.sampled_logprobs, ref.gather(1, ids[:, None]).squeeze(1))
    want_top = ref.topk(5, dim=-1)
    torch.testing.assert_close(out.topk_logprobs, want_top.values)
    assert torch.equal(out.topk_token_ids, want_top.indices)
    ranks = [int((ref[i] > ref[i, t]).sum()) + 1 for i, t in enumerate(ids.tolist())]
    assert out.sampled_ranks is not None and out.sampled_ranks.tolist() == ranks
    assert ranks[4] == 1  # the greedy row took the raw argmax
    lps = out.to_token_logprobs()
    assert [lp.token_id for lp in lps] == ids.tolist()
    assert list(lps[1].top) == want_top.indices[1].tolist()
    assert list(lps[1].top.values()) == pytest.approx(want_top.values[1].tolist())
    assert lps[1].logprob == pytest.approx(ref[1, lps[1].token_id].item())


def test_no_logprobs_when_not_asked(logits: torch.Tensor) -> None:
    out = Sampler()(logits, build([SamplingParams()] * 6))
    assert not out.has_logprobs
    with pytest.raises(ValueError, match="logprobs"):
        out.to_token_logprobs()


def test_prompt_logprobs() -> None:
    logits = torch.randn(5, 30, generator=gen(3))
    targets = torch.tensor([4, 0, 29, 7, 7])
    got = compute_prompt_logprobs(logits, targets, 3)
    ref = torch.log_softmax(logits, dim=-1)
    assert len(got) == 5
    for i, lp in enumerate(got):
        t = targets[i].item()
        assert lp.token_id == t
        assert lp.logprob == pytest.approx(ref[i, t].item(), abs=1e-5)
        assert lp.rank == int((ref[i] > ref[i, t]).sum()) + 1
        top = ref[i].topk(3)
        assert list(lp.top) == top.indices.tolist()
        assert list(lp.top.values()) == pytest.approx(top.values.tolist(), abs=1e-5)
    assert all(lp.top == {} for lp in compute_prompt_logprobs(logits, targets, 0))
    with pytest.raises(ValueError, match="target_ids"):
        compute_prompt_logprobs(logits, targets[:3], 1)


def test_tied_top_logprobs_list_the_greedy_token_first() -> None:
    # bf16 logits tie often: the top list must agree with argmax, which takes the lowest id.
    logits = torch.full((2, 50), -5.0)
    logits[0, [7, 31, 40]] = 2.0
    logits[1, [3, 30]] = 1.0
    logits[1, 44] = 1.5
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy = logits.argmax(dim=-1)
    chosen, ranks, top_ids, top_lps = gather_logprobs(logprobs, greedy, 4)
    # (The fourth entries are any of the many tokens tied at -5.)
    assert top_ids[:, :3].tolist() == [[7, 31, 40], [44, 3, 30]]
    assert torch.equal(top_ids[:, 0], greedy)
    assert ranks.tolist() == [1, 1]
    assert torch.all(top_lps[:, :-1] >= top_lps[:, 1:])
    assert torch.equal(chosen, logprobs.gather(1, greedy[:, None]).squeeze(1))
