"""Asynchronous scheduling on a real GPU: the next step is launched while the last one runs,
its inputs copied from the last one's samples on the device, its outputs read back through
pinned memory. Dummy weights of Qwen3-0.6B's shape (the tokenizer is the embedded one's).
Every test here skips without CUDA (CI has none)."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time",
           "Q: What do bees make?\nA:", "import numpy as np\n" * 6]


def _generate(async_scheduling: bool, dtype: str, enforce_eager: bool = False,
              ) -> tuple[list[list[int]], bool]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model="qwen3-0.6b", load_format="dummy", device="cuda", dtype=dtype,
              max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.3,
              enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    # Every request decodes in every step until the same last one (same max_tokens, no EOS):
    # the batches are the same either way, so the tokens must be too.
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 4 + [
        SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)] * 2
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    used = llm.engine.core.async_scheduling
    llm.engine.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, used


@pytest.mark.parametrize("dtype,eager", [("bfloat16", False), ("float32", True)])
def test_pipelined_steps_give_the_step_by_step_tokens(dtype: str, eager: bool) -> None:
    step_by_step, used = _generate(False, dtype, eager)
    assert not used
    pipelined, used = _generate(True, dtype, eager)
    assert used
    assert pipelined == step_by_step
    assert all(len(t) == 24 for t in pipelined)


def test_on_by_default_on_cuda() -> None:
    from tokenmill import LLM

    llm = LLM(model="qwen3-0.6b", load_format="dummy", device="cuda", max_model_len=256,
              gpu_memory_utilization=0.3)
    assert llm.engine.core.async_scheduling
    llm.engine.close()
