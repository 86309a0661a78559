"""The engine's features on its CUDA path: the Triton attention backend, decode steps replayed
from captured graphs, asynchronous scheduling. A workload that preempts, chunks its prefills,
hits the prefix cache, forks (n=2), samples with seeds, penalties, logprobs and a grammar, and
stops every way gives the outputs of the CPU engine's step-by-step reference; speculative
decoding through Triton gives plain decoding's tokens.

Without a GPU the kernels run in Triton's interpreter and :class:`EagerReplay` stands in for
the graphs (tiny-llama, dummy fp32 weights). tests/gpu/test_engine_features_cuda.py runs the
same workload on a real GPU with the embedded model.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine_workload import assert_same_outputs, feature_workload, summarize  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tokenmill.runner.cuda_graphs import EagerReplay  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the GPU runs tests/gpu/test_engine_features_cuda.py")

# 14 blocks of 16 tokens for up to 6 sequences of up to ~90 tokens: they preempt.
SMALL = dict(model="tiny-llama", load_format="dummy", dtype="float32", quantization="none",
             max_model_len=256, num_kv_blocks=14, max_num_seqs=6, max_num_batched_tokens=64)


def _sharp(llm: LLM) -> LLM:
    """Dummy matrices scaled from N(0, 0.02) to N(0, 0.12): at 0.02 tiny-llama's attention is
    nearly uniform, and its tokens would not notice a key missed or misplaced. (Much sharper,
    its greedy tokens never repeat, and the n-gram proposer would find nothing to draft.)"""
    with torch.no_grad():
        for p in llm.engine.core.executor.runner.model.parameters():
            if p.ndim >= 2:
                p.mul_(6.0)
    return llm


def _on_the_cuda_path(llm: LLM) -> LLM:
    """Switch the engine to the Triton backend and stand-in decode graphs, as EngineCore does
    on CUDA."""
    runner = llm.engine.core.executor.runner
    runner.backend = TritonAttentionBackend(decode_partition_size=32)
    runner.fused_decoder = None
    runner.capture_decode_graphs(SMALL["max_num_seqs"], llm.engine.core.max_model_len,
                                 capturer=EagerReplay())
    return llm


def test_the_workload_through_triton_gives_the_reference_outputs() -> None:
    prompts, params = feature_workload()
    reference = _sharp(LLM(**SMALL, async_scheduling=False))  # type: ignore[arg-type]
    want = summarize(reference.generate(prompts, params, use_tqdm=False))
    del reference

    llm = _on_the_cuda_path(_sharp(LLM(**SMALL, async_scheduling=True)))  # type: ignore[arg-type]
    replays = []
    run = llm.engine.core.executor.runner.decode_graphs.run

    def counted(*args: object) -> torch.Tensor:
        replays.append(args[0].shape[0])  # type: ignore[union-attr]
        return run(*args)

    llm.engine.core.executor.runner.decode_graphs.run = counted
    got = summarize(llm.generate(prompts, params, use_tqdm=False))
    assert_same_outputs(got, want, atol=1e-4)  # attention kernels that round differently
    core = llm.engine.core
    assert replays  # decode steps went through the graphs
    assert core.scheduler.num_preemptions_total > 0
    assert core.scheduler.kv.prefix_stats.hits > 0
    kv = core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


@pytest.mark.parametrize("spec", [dict(speculative="ngram", num_speculative_tokens=4),
                                  dict(speculative_model="self:1", num_speculative_tokens=3)],
                         ids=["ngram", "self-draft"])
def test_speculative_decoding_through_triton_gives_the_plain_tokens(spec: dict) -> None:
    """Verification steps take several query tokens a sequence: they run the prefill kernel
    over the cached context, never a decode graph."""
    prompts = [[5, 6, 7, 8] * 6, [11, 12, 13], [21, 22] * 10 + [23]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(SMALL, num_kv_blocks=64)
    plain = _sharp(LLM(**common))  # type: ignore[arg-type]
    want = [o.outputs[0].token_ids
            for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    del plain
    llm = _on_the_cuda_path(_sharp(LLM(**common, **spec)))  # type: ignore[arg-type]
    got = [o.outputs[0].token_ids
           for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    stats = llm.engine.core.spec_stats
    assert stats is not None and stats.num_drafts > 0
