"""bench.latency.start_decoding, which the step profilers use to reach decode-only steps."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.bench.latency import start_decoding


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_request_decodes_when_the_batch_takes_many_steps_to_prefill(
        async_scheduling: bool) -> None:
    # 6 prompts of 100 tokens at 64 tokens a step: 10 prefill steps, more than the 3 decode
    # steps asked for; the first prompts must not finish before the last have started.
    llm = LLM(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64,
              async_scheduling=async_scheduling)
    engine = llm.engine
    start_decoding(engine, 6, 100, 3, seed=1)
    requests = engine.core.scheduler.requests
    assert all(requests[f"p1-{i}"].num_output_tokens >= 1 for i in range(6))
    for _ in range(3):  # the decode steps asked for are there to take
        engine.step()
        assert engine.core.last_batch[0] == 6


def test_a_cache_too_small_for_the_batch_is_named() -> None:
    llm = LLM(max_model_len=256, num_kv_blocks=12, max_num_batched_tokens=64)
    with pytest.raises(RuntimeError, match="KV cache holds too few"):
        start_decoding(llm.engine, 6, 100, 3, seed=1)
    # The engine is unharmed: the queued requests finish, and the next one is answered.
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    out = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
