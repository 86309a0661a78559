"""Qwen3-MoE and Mixtral through the whole engine (LLM) against transformers' greedy tokens
and logprobs in fp32: one batch, chunked prefill, prefix caching, preemption, n > 1; and the
step backend said at start (the CPU op program, whose moe op runs the sparse layers)."""

from __future__ import annotations

import logging

import pytest
import torch
from hf_checkpoints import Checkpoint
from test_models_parity import prompts
from test_moe_parity import make_moe_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.runner.step_backend import CpuProgramBackend

PROMPT_LENS = (3, 17, 40, 9)
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_moe_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llm(moe: Checkpoint) -> LLM:
    return LLM(str(moe.path), dtype="float32", quantization="none", max_model_len=256)


def greedy(max_tokens: int = MAX_TOKENS, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          **kw)  # type: ignore[arg-type]


@torch.no_grad()
def hf_greedy(ckpt: Checkpoint, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (no cache: the whole sequence each step) and the
    chosen tokens' logprobs."""
    seq, logprobs = list(ids), []
    for _ in range(n):
        logits = ckpt.hf_model(torch.tensor([seq])).logits[0, -1].float()
        tok = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        seq.append(tok)
    return seq[len(ids):], logprobs


@pytest.fixture(scope="module")
def reference(moe: Checkpoint) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, transformers' greedy tokens, their logprobs) for each prompt."""
    return [(p, *hf_greedy(moe, p, MAX_TOKENS))
            for p in prompts(moe.arch.vocab_size, PROMPT_LENS, seed=7)]


def tokens(outputs: list) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_greedy_tokens_and_logprobs_match_transformers(llm: LLM, reference: list) -> None:
    outs = llm.generate([p for p, _, _ in reference], greedy(logprobs=0))
    for out, (_, want, want_lp) in zip(outs, reference, strict=True):
        got = out.outputs[0]
        assert got.token_ids == want
        got_lp = [lp.logprob for lp in got.logprobs]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) <= 1e-3


def test_chunked_prefill_gives_the_same_tokens(moe: Checkpoint, reference: list) -> None:
    small = LLM(str(moe.path), dtype="float32", quantization="none", max_model_len=256,
                max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert tokens(small.generate([p for p, _, _ in reference], greedy())) == [
        w for _, w, _ in reference]


def test_prefix_caching_gives_the_same_tokens(llm: LLM, moe: Checkpoint) -> None:
    shared = prompts(moe.arch.vocab_size, (40,), seed=8)[0]
    tails = prompts(moe.arch.vocab_size, (3, 6), seed=9)
    stats = llm.engine.core.scheduler.kv.prefix_stats
    hits = stats.hits
    got = [tokens(llm.generate([shared + t], greedy()))[0] for t in tails]  # one at a time
    assert stats.hits - hits >= 2 * 16  # the second request found the shared blocks
    assert got == [hf_greedy(moe, shared + t, MAX_TOKENS)[0] for t in tails]


def test_preemption_under_a_small_kv_cache(moe: Checkpoint, reference: list) -> None:
    small = LLM(str(moe.path), dtype="float32", quantization="none", max_model_len=128,
                num_kv_blocks=6, block_size=16, max_num_batched_tokens=64)
    got = tokens(small.generate([p for p, _, _ in reference], greedy()))
    assert small.engine.core.scheduler.num_preemptions_total > 0
    assert got == [w for _, w, _ in reference]


def test_n_greedy_samples_equal_one(llm: LLM, reference: list) -> None:
    prompt, want, _ = reference[1]
    (out,) = llm.generate([prompt], greedy(n=3))
    assert [c.token_ids for c in out.outputs] == [want] * 3
    seeded = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = llm.generate([prompt], seeded)[0].outputs
    assert [c.token_ids for c in llm.generate([prompt], seeded)[0].outputs] == [
        c.token_ids for c in again]
    # The next normal request is answered as before.
    assert tokens(llm.generate([prompt], greedy())) == [want]


def test_step_backend_is_the_cpu_program_said_at_start(moe: Checkpoint,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        engine = LLM(str(moe.path), dtype="float32", quantization="none", max_model_len=64)
    runner = engine.engine.core.executor.runner
    assert isinstance(runner.step_backend, CpuProgramBackend)
    assert "step backend: cpu program" in caplog.text
