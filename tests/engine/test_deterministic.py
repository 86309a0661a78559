"""The deterministic engine: a greedy request's tokens do not depend on what shares its steps.

The default int4 engine on the embedded SmolLM2 (what `tokenmill serve` runs), at the default
token budget and at a small one that chunks long prompts into other requests' decode steps.
Without ``deterministic`` each comparison below fails: a prompt token takes the int4 kernel
or the dense bf16 matmul depending on how many tokens share its step, and a decode token
beside a prefill goes through ``model.forward`` instead of the fused stack.
"""

from __future__ import annotations

import argparse

import pytest
from engine_workload import MIXED_PROMPTS

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, ParallelConfig
from tokenmill.engine.args import add_engine_args, engine_config_from_args

# 16 prompts of 1 to 20 tokens: together 152, past the 96 rows from which the int4 layers'
# default path switches to the dense bf16 matmul.
PROMPTS = MIXED_PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(max_num_batched_tokens: int) -> LLM:
    # The default quantization: the embedded file's int4 weights and int8 head.
    return LLM(deterministic=True, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
               max_num_batched_tokens=max_num_batched_tokens)


@pytest.fixture(scope="module")
def det_llm() -> LLM:
    """The default token budget: the prompts together are prefilled in one step."""
    return _engine(512)


@pytest.fixture(scope="module")
def det_small() -> LLM:
    """A budget of 64 tokens: long prompts are chunked into the others' decode steps."""
    return _engine(64)


def _tokens(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def alone(det_llm: LLM) -> list[list[int]]:
    return [_tokens(det_llm, [p], [GREEDY])[0] for p in PROMPTS]


def test_together_equals_alone(det_llm: LLM, alone: list[list[int]]) -> None:
    assert _tokens(det_llm, PROMPTS, [GREEDY] * len(PROMPTS)) == alone


def test_beside_chunked_prefills_equals_alone(det_small: LLM, alone: list[list[int]],
                                              long_prompt: list[int]) -> None:
    # The long prompt first: the others' prefills and decodes share steps with its chunks.
    beside = _tokens(det_small, [long_prompt, *PROMPTS],
                     [SamplingParams(temperature=0.0, max_tokens=2)] + [GREEDY] * len(PROMPTS))
    assert beside[1:] == alone


@pytest.fixture(scope="module")
def long_prompt(det_llm: LLM) -> list[int]:
    """300 tokens of text: far more than the small engine's budget, so prefilled in chunks."""
    return det_llm.get_tokenizer().encode(" ".join(PROMPTS) * 3)[:300]


def test_a_chunked_prompt_continues_as_a_whole_one(det_llm: LLM, det_small: LLM,
                                                    long_prompt: list[int]) -> None:
    whole = _tokens(det_llm, [long_prompt], [GREEDY])[0]
    assert _tokens(det_small, [long_prompt], [GREEDY])[0] == whole
    assert _tokens(det_small, [PROMPTS[0], long_prompt], [GREEDY, GREEDY])[1] == whole


def test_speculative_decoding_changes_no_token(det_llm: LLM) -> None:
    # Verification rows are laid out as decode rows too: drafts only change the speed.
    spec = LLM(deterministic=True, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
               speculative="ngram")
    prompts = PROMPTS[:4]
    got = _tokens(spec, prompts, [GREEDY] * len(prompts))
    assert spec.engine.stats().spec_decoding.num_draft_tokens > 0
    assert got == _tokens(det_llm, prompts, [GREEDY] * len(prompts))


def test_preemption_changes_no_token(alone: list[list[int]]) -> None:
    # 12 blocks of 16 tokens hold about 4 of the 8 requests: the newest are preempted and
    # recomputed, their output tokens now as prompt-like chunks.
    small = LLM(deterministic=True, max_model_len=256, num_kv_blocks=12,
                max_num_batched_tokens=128)
    got = _tokens(small, PROMPTS[:8], [GREEDY] * 8)
    assert small.engine.core.scheduler.num_preemptions_total > 0
    assert got == alone[:8]


def test_deterministic_is_refused_where_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2), deterministic=True)
    with pytest.raises(ValueError, match="CPU"):
        LLM(deterministic=True, device="cuda:0")
    # fp32 matmuls round a row differently by batch size: only the int kernels qualify.
    with pytest.raises(ValueError, match="int8 or int4"):
        LLM(deterministic=True, quantization="none", max_model_len=256,
            kv_cache_memory_bytes=16 << 20)


def test_cli_flag() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--deterministic"])).deterministic
    assert not engine_config_from_args(p.parse_args([])).deterministic



def test_beam_search_beside_other_requests_equals_alone(det_llm: LLM, det_small: LLM) -> None:
    """A beam search's hypotheses and their logprobs do not depend on what shares its steps
    (its beams' candidates are each row's own logprobs)."""
    beams = SamplingParams(n=3, use_beam_search=True, max_tokens=12, logprobs=2)

    def hypotheses(llm: LLM, prompts: list, params: list[SamplingParams]) -> list:
        out = llm.generate(prompts, params, use_tqdm=False)[0].outputs
        return [(c.token_ids, [lp.logprob for lp in c.logprobs]) for c in out]

    alone = hypotheses(det_llm, [PROMPTS[3]], [beams])
    assert hypotheses(det_llm, [PROMPTS[3], *PROMPTS[:8]], [beams] + [GREEDY] * 8) == alone
    assert hypotheses(det_small, [PROMPTS[3], *PROMPTS], [beams] + [GREEDY] * 16) == alone
