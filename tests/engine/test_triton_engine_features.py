"""The engine's features on its CUDA path: the Triton attention backend, decode steps replayed
from captured graphs, asynchronous scheduling. A workload that preempts, chunks its prefills,
hits the prefix cache, forks (n=2), samples with seeds, penalties, logprobs and a grammar
(its bitmask applied to the device's logits), and stops every way, gives the outputs of a
step-by-step eager reference; speculative decoding, whose verification rows go through the
decode kernel, gives plain decoding's tokens.

On a GPU this is the real thing: the engine's own backend, graphs and scheduling, against a
reference with PyTorch's attention. Without one, the kernels run in Triton's interpreter,
:class:`EagerReplay` stands in for the graphs, and the reference is the CPU engine. Either way
the model is tiny-llama with dummy fp32 weights (a GPU run carries no model file).
"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")

from engine_workload import assert_same_outputs, feature_workload, summarize  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.attention.backend import TorchAttentionBackend  # noqa: E402
from tokenmill.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tokenmill.runner.cuda_graphs import EagerReplay  # noqa: E402

CUDA = torch.cuda.is_available()
# 14 blocks of 16 tokens for up to 6 sequences of up to ~90 tokens: they preempt.
SMALL = dict(model="tiny-llama", load_format="dummy", dtype="float32", quantization="none",
             device="cuda" if CUDA else "cpu", max_model_len=256, num_kv_blocks=14,
             max_num_seqs=6, max_num_batched_tokens=64)


def _sharp(llm: LLM) -> LLM:
    """Dummy matrices scaled from N(0, 0.02) to N(0, 0.12): at 0.02 tiny-llama's attention is
    nearly uniform, and its tokens would not notice a key missed or misplaced. (Much sharper,
    its greedy tokens never repeat, and the n-gram proposer would find nothing to draft.)"""
    with torch.no_grad():
        for p in llm.engine.core.executor.runner.model.parameters():
            if p.ndim >= 2:
                p.mul_(6.0)
    return llm


def _reference(**kw: object) -> LLM:
    """Step by step and eager: the CPU engine, or on a GPU PyTorch's attention over the same
    paged cache."""
    llm = LLM(**SMALL | kw, enforce_eager=True, async_scheduling=False)  # type: ignore[arg-type]
    if CUDA:
        llm.engine.core.executor.runner.backend = TorchAttentionBackend()
    return _sharp(llm)


def _cuda_path(**kw: object) -> LLM:
    """The engine as it runs on CUDA: Triton attention, decode graphs and (unless it
    speculates) asynchronous scheduling; on the CPU, switched to them after start-up."""
    if CUDA:
        llm = LLM(**SMALL | kw)  # type: ignore[arg-type]
    else:
        speculates = "speculative" in kw or "speculative_model" in kw
        llm = LLM(**SMALL | kw, async_scheduling=not speculates)  # type: ignore[arg-type]
        runner = llm.engine.core.executor.runner
        runner.backend = TritonAttentionBackend(decode_partition_size=32)
        runner.cpu_program = None
        runner.capture_decode_graphs(SMALL["max_num_seqs"], llm.engine.core.max_model_len,
                                     capturer=EagerReplay())
    runner = llm.engine.core.executor.runner
    assert runner.backend.name == "triton" and runner.decode_graphs is not None
    return _sharp(llm)


def _free_device_memory() -> None:
    """Give back what dropped engines held (they may sit in reference cycles)."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def test_the_workload_through_triton_gives_the_reference_outputs() -> None:
    prompts, params = feature_workload()
    want = summarize(_reference().generate(prompts, params, use_tqdm=False))
    _free_device_memory()

    llm = _cuda_path()
    core = llm.engine.core
    assert core.async_scheduling
    graphs = core.executor.runner.decode_graphs
    replays = []
    run = graphs.run

    def counted(*args: object) -> torch.Tensor:
        replays.append(args[0].shape[0])  # type: ignore[union-attr]
        return run(*args)

    graphs.run = counted
    got = summarize(llm.generate(prompts, params, use_tqdm=False))
    # The attention kernels round differently: logprobs agree to fp32's rounding only.
    assert_same_outputs(got, want, atol=1e-3 if CUDA else 1e-4)
    assert replays  # decode steps went through the graphs
    assert core.scheduler.num_preemptions_total > 0
    assert core.scheduler.kv.prefix_stats.hits > 0
    kv = core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


@pytest.mark.parametrize("spec", [dict(speculative="ngram", num_speculative_tokens=4),
                                  dict(speculative_model="self:1", num_speculative_tokens=3)],
                         ids=["ngram", "self-draft"])
def test_speculative_decoding_through_triton_gives_the_plain_tokens(spec: dict) -> None:
    """Each verified position is a row of its own in a decode step (the sequence's length up
    to it), so the drafts go through the decode kernel, and through its graphs when the rows
    fit the largest one."""
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8] * 6, [11, 12, 13],
                                                 [21, 22] * 10 + [23])]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids
            for o in _reference(num_kv_blocks=64).generate(prompts, params, use_tqdm=False)]
    _free_device_memory()
    llm = _cuda_path(num_kv_blocks=64, **spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.core.spec_stats
    assert stats is not None and stats.num_accepted_tokens > 0


def test_beam_search_through_triton_gives_the_reference_beams() -> None:
    """Beams are decode rows of the graphs, each a new request on its parent's blocks (a
    partly filled block copied on the device when two beams continue one parent), beside a
    plain request."""
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8] * 5, [11, 12, 13],
                                                 [21, 22] * 9 + [23])]
    params = [SamplingParams(n=3, use_beam_search=True, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=2, use_beam_search=True, max_tokens=16, length_penalty=0.5,
                             ignore_eos=True)]

    def beams(llm: LLM) -> list[list[list[int]]]:
        return [[c.token_ids for c in o.outputs]
                for o in llm.generate(prompts, params, use_tqdm=False)]

    want = beams(_reference(num_kv_blocks=64))
    _free_device_memory()
    llm = _cuda_path(num_kv_blocks=64)
    assert beams(llm) == want
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
