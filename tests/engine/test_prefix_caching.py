"""Prefix caching and n > 1 samples sharing KV blocks, end to end on the embedded model."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams

SYSTEM = ("You are a meticulous assistant for a hardware store. Answer in one short sentence, "
          "name the aisle when you can, and never invent prices. ") * 3
QUESTIONS = ["Where are the hammers?", "Do you sell paint?", "Where are the screws?",
             "Can I rent a ladder?"]


def chats() -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in QUESTIONS]


def token_ids(outputs: list) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def uncached() -> LLM:
    return LLM(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=128 << 20,
               quantization="none", enable_prefix_caching=False)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24),
    SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24),
], ids=["greedy", "seeded"])
def test_outputs_equal_with_and_without_prefix_caching(llm: LLM, uncached: LLM,
                                                       params: SamplingParams) -> None:
    stats = llm.engine.core.scheduler.kv.prefix_stats
    hits_before = stats.hits
    # One at a time, so that every request after the first finds the system prompt cached.
    cached = [llm.chat(c, params)[0] for c in chats()]
    plain = [uncached.chat(c, params)[0] for c in chats()]
    assert token_ids(cached) == token_ids(plain)
    # The system prompt is ~90 tokens: the last three requests hit at least 5 blocks each.
    assert stats.hits - hits_before >= 3 * 5 * 16
    assert uncached.engine.core.scheduler.kv.prefix_stats.queries == 0


def test_cached_blocks_survive_their_request_and_are_evicted_lru(llm: LLM) -> None:
    kv = llm.engine.core.scheduler.kv
    prompt = list(range(2000, 2100))
    llm.generate([prompt], SamplingParams(max_tokens=1))
    assert kv.usage == 0.0  # freed, but still registered
    hits = kv.find_cached_prefix("probe", prompt)
    kv.forget("probe")
    assert len(hits) == (len(prompt) - 1) // kv.block_size


def test_greedy_samples_share_the_prompt_and_equal_one_sample(llm: LLM) -> None:
    runner = llm.engine.core.executor.runner
    copies: list[tuple[int, int]] = []
    original = runner.copy_blocks

    def record(pairs: list[tuple[int, int]]) -> None:
        copies.extend(pairs)
        original(pairs)

    runner.copy_blocks = record  # type: ignore[method-assign]
    try:
        prompt = list(range(3000, 3037))  # 37 tokens: 2 full blocks + a partial one
        one = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
        four = llm.generate([prompt], SamplingParams(n=4, temperature=0.0, max_tokens=16))
    finally:
        del runner.copy_blocks
    assert [c.token_ids for c in four[0].outputs] == [one[0].outputs[0].token_ids] * 4
    # Samples 1-3 each copied the block their last prompt token is written to, and no more.
    assert len(copies) == 3 and len({src for src, _ in copies}) == 1


def test_samples_differ_and_their_seeds_reproduce(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12)
    first = [c.token_ids for c in llm.generate("Once upon a time", params)[0].outputs]
    again = [c.token_ids for c in llm.generate("Once upon a time", params)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) > 1


def test_each_output_says_how_many_prompt_tokens_came_from_the_cache(llm: LLM,
                                                                     uncached: LLM) -> None:
    # 6 full blocks of 16 and 4 tokens, ids no other test's prompt shares.
    prompt = random.Random(8231).sample(range(1000, 49000), 100)
    params = SamplingParams(max_tokens=2)
    first = llm.generate([prompt], params)[0]
    assert first.metrics.num_cached_tokens == 0
    # The same prompt again: its full blocks are hits; the last, partial block is computed.
    again = llm.generate([prompt], params)[0]
    assert again.metrics.num_cached_tokens == 6 * 16
    # A prompt sharing the first 40 tokens reuses two whole blocks; n > 1 reports it once.
    shared = llm.generate([prompt[:40] + [7] * 30], SamplingParams(max_tokens=2, n=3))[0]
    assert shared.metrics.num_cached_tokens == 2 * 16
    assert uncached.generate([prompt], params)[0].metrics.num_cached_tokens == 0
