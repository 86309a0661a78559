"""gpt-oss through the whole engine (LLM) against transformers' greedy tokens and logprobs in
fp32, prompts and continuations past the sliding window: one batch, chunked prefill, prefix
caching, preemption, n > 1; the step backend said at start (eager: the CPU op program has no
lowering for gpt-oss's layers); `tokenmill info` on it."""

from __future__ import annotations

import logging

import pytest
import torch
from gpt_oss_checkpoint import WINDOW, make_gpt_oss_checkpoint
from hf_checkpoints import Checkpoint
from test_models_parity import prompts

from tokenmill import LLM, SamplingParams
from tokenmill.runner.step_backend import EagerBackend

PROMPT_LENS = (3, WINDOW, 19, 41)
MAX_TOKENS = 12  # the shortest prompt's continuation passes the window too


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss_engine"))


@pytest.fixture(scope="module")
def llm(gpt_oss: Checkpoint) -> LLM:
    return LLM(str(gpt_oss.path), dtype="float32", quantization="none", max_model_len=256)


def greedy(max_tokens: int = MAX_TOKENS, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          **kw)  # type: ignore[arg-type]


@torch.no_grad()
def hf_greedy(ckpt: Checkpoint, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (the whole sequence each step) and the chosen
    tokens' logprobs."""
    seq, logprobs = list(ids), []
    for _ in range(n):
        logits = ckpt.hf_model(torch.tensor([seq])).logits[0, -1].float()
        tok = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        seq.append(tok)
    return seq[len(ids):], logprobs


@pytest.fixture(scope="module")
def reference(gpt_oss: Checkpoint) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, transformers' greedy tokens, their logprobs) for each prompt."""
    return [(p, *hf_greedy(gpt_oss, p, MAX_TOKENS))
            for p in prompts(gpt_oss.arch.vocab_size, PROMPT_LENS, seed=7)]


def tokens(outputs: list) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_greedy_tokens_and_logprobs_match_transformers(llm: LLM, reference: list) -> None:
    outs = llm.generate([p for p, _, _ in reference], greedy(logprobs=0))
    for out, (_, want, want_lp) in zip(outs, reference, strict=True):
        got = out.outputs[0]
        assert got.token_ids == want
        got_lp = [lp.logprob for lp in got.logprobs]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) <= 1e-3


def test_chunked_prefill_gives_the_same_tokens(gpt_oss: Checkpoint, reference: list) -> None:
    small = LLM(str(gpt_oss.path), dtype="float32", quantization="none", max_model_len=256,
                max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert tokens(small.generate([p for p, _, _ in reference], greedy())) == [
        w for _, w, _ in reference]


def test_prefix_caching_gives_the_same_tokens(llm: LLM, gpt_oss: Checkpoint) -> None:
    shared = prompts(gpt_oss.arch.vocab_size, (40,), seed=8)[0]
    tails = prompts(gpt_oss.arch.vocab_size, (3, 6), seed=9)
    stats = llm.engine.core.scheduler.kv.prefix_stats
    hits = stats.hits
    got = [tokens(llm.generate([shared + t], greedy()))[0] for t in tails]  # one at a time
    assert stats.hits - hits >= 2 * 16  # the second request found the shared blocks
    assert got == [hf_greedy(gpt_oss, shared + t, MAX_TOKENS)[0] for t in tails]


def test_preemption_under_a_small_kv_cache(gpt_oss: Checkpoint, reference: list) -> None:
    small = LLM(str(gpt_oss.path), dtype="float32", quantization="none", max_model_len=64,
                num_kv_blocks=5, block_size=16, max_num_batched_tokens=64)
    got = tokens(small.generate([p for p, _, _ in reference], greedy()))
    assert small.engine.core.scheduler.num_preemptions_total > 0
    assert got == [w for _, w, _ in reference]


def test_n_greedy_samples_equal_one(llm: LLM, reference: list) -> None:
    prompt, want, _ = reference[2]
    (out,) = llm.generate([prompt], greedy(n=3))
    assert [c.token_ids for c in out.outputs] == [want] * 3
    seeded = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = llm.generate([prompt], seeded)[0].outputs
    assert [c.token_ids for c in llm.generate([prompt], seeded)[0].outputs] == [
        c.token_ids for c in again]
    # The next normal request is answered as before.
    assert tokens(llm.generate([prompt], greedy())) == [want]


def test_step_backend_is_eager_and_says_why_at_start(gpt_oss: Checkpoint,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        engine = LLM(str(gpt_oss.path), dtype="float32", quantization="none", max_model_len=64)
    runner = engine.engine.core.executor.runner
    assert isinstance(runner.step_backend, EagerBackend)
    assert "CPU op program off" in caplog.text and "model.layers.0" in caplog.text


def test_info_on_the_checkpoint(gpt_oss: Checkpoint, capsys: pytest.CaptureFixture) -> None:
    from tokenmill.cli import main
    from tokenmill.model_loader.info import summarize

    summary = summarize(str(gpt_oss.path))
    assert summary.family == "GptOssForCausalLM"
    assert summary.sliding_layers == 2 and summary.sliding_window == WINDOW
    # Active parameters: 2 of the 6 experts a layer.
    experts = sum(p.numel() for n, p in gpt_oss.model.named_parameters() if "experts" in n)
    assert summary.total_params - summary.active_params == experts * 4 // 6
    assert main(["info", str(gpt_oss.path), "--no-load"]) == 0
    assert "GptOssForCausalLM" in capsys.readouterr().out


def test_int8_and_int4_experts_keep_biases_and_the_clamped_swiglu(gpt_oss: Checkpoint,
                                                                  reference: list) -> None:
    """Weight-only int8/int4 quantize each expert's products and keep its float biases and
    the clamped SwiGLU: the experts' output stays within the quantization's error of the
    float experts', and the engine answers."""
    from tokenmill.quant.experts import QuantizedExperts

    experts = gpt_oss.model.model.layers[1].mlp.experts
    x = torch.randn(7, gpt_oss.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = gpt_oss.model.model.layers[1].mlp.router(x)
    want = experts(x, weights, ids)
    for method, tol in (("int8", 0.02), ("int4", 0.15)):
        engine = LLM(str(gpt_oss.path), dtype="float32", quantization=method,
                     max_model_len=64)
        model = engine.engine.core.executor.runner.model
        quantized = model.model.layers[1].mlp.experts
        assert isinstance(quantized, QuantizedExperts)
        err = (quantized(x, weights, ids) - want).abs().max().item()
        assert err <= tol * want.abs().max().item(), (method, err)
        (got,) = tokens(engine.generate([reference[0][0]], greedy()))
        assert len(got) == MAX_TOKENS  # (a random model's tokens flip under int4 / int8)
