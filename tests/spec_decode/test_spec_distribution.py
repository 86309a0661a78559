"""End to end on a tiny random model with 8 tokens: speculative sampling at temperature 1
draws the first three output tokens from exactly the target model's joint distribution."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from stats_helpers import chi_square_pvalue

from tokenmill.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenmill.engine.core import EngineCore
from tokenmill.model_loader import LoadedModel
from tokenmill.model_loader.dummy import build_dummy_model
from tokenmill.models.config import ArchConfig
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

V = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so prompt lookup has guesses
NUM_SAMPLES = 6000


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    arch = ArchConfig(architecture="LlamaForCausalLM", vocab_size=V, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = build_dummy_model(arch, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights large enough for distributions far from uniform
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.25, generator=gen)
    tokenizer = SimpleNamespace(eos_token_ids=frozenset())
    return LoadedModel(model=model, arch=arch, path="tiny",
                       tokenizer=tokenizer)  # type: ignore[arg-type]


def make_core(tiny: LoadedModel, spec: SpeculativeConfig) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(dtype="float32"), cache=CacheConfig(block_size=4, num_blocks=1100),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),
        device=DeviceConfig(device="cpu"), speculative=spec)
    return EngineCore(config, loaded=tiny)


def generate(core: EngineCore, prompts: list[list[int]], params: SamplingParams,
             ) -> dict[str, list]:
    """Outputs (tokens, or logprobs when asked) per request id, in prompt order."""
    outs: dict[str, list] = {}
    for i, prompt in enumerate(prompts):
        core.add_request(Request(str(i), prompt, params))
        outs[str(i)] = []
    while core.has_unfinished_requests():
        for o in core.step():
            outs[o.request_id].extend(o.new_logprobs if params.logprobs else o.new_token_ids)
    return outs


def exact_joint(tiny: LoadedModel) -> torch.Tensor:
    """P(t0, t1, t2) of the target model at temperature 1, from its logprobs on every prefix."""
    core = make_core(tiny, SpeculativeConfig())
    params = SamplingParams(temperature=1.0, max_tokens=1, logprobs=V)

    def next_probs(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        outs = generate(core, [PROMPT + list(p) for p in prefixes], params)
        rows = []
        for i in range(len(prefixes)):
            top = outs[str(i)][0].top
            rows.append(torch.tensor([top[t] for t in range(V)]).exp())
        return torch.stack(rows)

    p0 = next_probs([()])[0]
    p1 = next_probs([(a,) for a in range(V)])
    p2 = next_probs(list(itertools.product(range(V), repeat=2))).view(V, V, V)
    return p0[:, None, None] * p1[:, :, None] * p2


@pytest.mark.parametrize("spec", [
    SpeculativeConfig("ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=4),
    SpeculativeConfig("draft", num_speculative_tokens=2, draft_model="self:1"),
], ids=["ngram", "self-draft"])
def test_speculative_sampling_matches_the_target_distribution(
        tiny: LoadedModel, spec: SpeculativeConfig) -> None:
    joint = exact_joint(tiny)
    assert joint.max() < 0.2  # a distribution with room for a wrong sampler to show
    torch.manual_seed(0)
    core = make_core(tiny, spec)
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    outs = generate(core, [PROMPT] * NUM_SAMPLES, params)
    stats = core.spec_stats
    assert stats is not None and stats.num_draft_tokens > NUM_SAMPLES
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    counts = torch.zeros(V, V, V)
    for tokens in outs.values():
        assert len(tokens) == 5
        counts[tokens[0], tokens[1], tokens[2]] += 1
    assert chi_square_pvalue(counts, joint) > 1e-3
