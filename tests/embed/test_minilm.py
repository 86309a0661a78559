"""The embedded all-MiniLM-L6-v2 through the engine: parity with sentence-transformers,
batching, truncation and the errors of bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tokenmill import LLM
from tokenmill.bench.embed_sentences import PARITY_SENTENCES
from tokenmill.sampling_params import PoolingParams, SamplingParams


def _cos(a: list[float], b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b.float(), dim=0))


def test_parity_with_sentence_transformers(embed_llm: LLM, st_model: Any) -> None:
    assert len(PARITY_SENTENCES) >= 100
    outs = embed_llm.embed(list(PARITY_SENTENCES))
    refs = st_model.encode(list(PARITY_SENTENCES), convert_to_tensor=True, batch_size=32)
    sims = [_cos(o.embedding, r) for o, r in zip(outs, refs, strict=True)]
    assert min(sims) >= 0.999, min(sims)
    for out in outs:
        assert len(out.embedding) == 384
        assert math.isclose(math.sqrt(sum(x * x for x in out.embedding)), 1.0, rel_tol=1e-5)


def test_bf16_matmuls_keep_parity(minilm_path: str, st_model: Any,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """all-MiniLM-L6-v2 with its projections in bf16 (the "auto" dtype on CPUs that multiply
    bf16 natively; made to pick it here, so it runs on every CPU) against sentence-transformers
    in fp32. A subset of the parity sentences: where bf16 is not native it is emulated, slowly."""
    import tokenmill.model_loader as loader
    from tokenmill.models.layers import Bf16MatmulLinear

    monkeypatch.setattr(loader, "dense_dtype", lambda _device_type: torch.bfloat16)
    texts = list(PARITY_SENTENCES[::8])
    llm = LLM(minilm_path, task="embed")
    try:
        model = llm.engine.core.executor.runner.model
        assert any(isinstance(m, Bf16MatmulLinear) for m in model.modules())
        outs = llm.embed(texts)
    finally:
        llm.close()
    refs = st_model.encode(texts, convert_to_tensor=True, batch_size=32)
    sims = [_cos(o.embedding, r) for o, r in zip(outs, refs, strict=True)]
    assert min(sims) >= 0.999, min(sims)


MIXED_TEXTS = ["short", "a medium length sentence about nothing much",
               " ".join(["long"] * 120), "short", "another one, of medium length too"]


def _batched_and_alone(llm: LLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each of MIXED_TEXTS' embeddings from one step with all of them, and from a step alone."""
    together = llm.embed(MIXED_TEXTS)
    assert llm.engine.core.last_batch[0] == len(MIXED_TEXTS)  # all in one step
    pairs = []
    for text, out in zip(MIXED_TEXTS, together, strict=True):
        (alone,) = llm.embed(text)
        assert alone.prompt_token_ids == out.prompt_token_ids
        pairs.append((torch.tensor(out.embedding), torch.tensor(alone.embedding)))
    return pairs


def test_mixed_batch_equals_one_at_a_time(minilm_path: str) -> None:
    """fp32 projections: a text's embedding is the same alone or beside others in one step."""
    llm = LLM(minilm_path, task="embed", max_num_seqs=32, max_num_batched_tokens=1024,
              dtype="float32")
    try:
        for batched, alone in _batched_and_alone(llm):
            torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    finally:
        llm.close()


def test_mixed_batch_within_bf16_precision(embed_llm: LLM) -> None:
    """The default engine, bf16 projections where the CPU multiplies bf16 natively: oneDNN
    picks its bf16 kernels by the row count (on AMX, other kernels for one text than for five),
    so a matmul's fp32 sums, and the bf16 rounding of the next matmul's input, can differ by a
    step. On a Xeon with AMX a text's embedding moved by up to 5.3e-4 (cosine 0.999995) with its
    batch mates; fp32 engines keep 1e-5 (above). Far inside the parity goal against
    sentence-transformers (cosine >= 0.999)."""
    for batched, alone in _batched_and_alone(embed_llm):
        assert torch.nn.functional.cosine_similarity(batched, alone, dim=0) >= 0.9999
        torch.testing.assert_close(batched, alone, atol=2e-3, rtol=0)


def test_many_requests_share_a_step(minilm_path: str) -> None:
    llm = LLM(minilm_path, max_num_seqs=8, max_num_batched_tokens=512)
    try:
        engine = llm.engine
        for i in range(6):
            engine.add_request(f"r{i}", "word " * (3 + 7 * i), PoolingParams())
        outputs = engine.step()
        assert engine.core.last_batch[0] == 6  # all of them, of different lengths, at once
        assert sorted(o.request_id for o in outputs) == [f"r{i}" for i in range(6)]
        assert not engine.has_unfinished_requests()
    finally:
        llm.close()


def test_token_ids_input_and_dimensions(embed_llm: LLM) -> None:
    (text_out,) = embed_llm.embed("The cat sat on the mat.")
    (ids_out,) = embed_llm.embed([text_out.prompt_token_ids])
    assert ids_out.prompt_token_ids == text_out.prompt_token_ids
    torch.testing.assert_close(torch.tensor(ids_out.embedding), torch.tensor(text_out.embedding))
    (short,) = embed_llm.embed("The cat sat on the mat.", PoolingParams(dimensions=32))
    expected = torch.nn.functional.normalize(torch.tensor(text_out.embedding[:32]), dim=0)
    torch.testing.assert_close(torch.tensor(short.embedding), expected, atol=1e-6, rtol=1e-5)
    (raw,) = embed_llm.embed("The cat sat on the mat.", PoolingParams(normalize=False))
    assert math.sqrt(sum(x * x for x in raw.embedding)) > 1.5  # a mean of states, not unit


def test_truncation_keeps_the_special_tokens(embed_llm: LLM) -> None:
    long_text = "word " * 400
    with pytest.raises(ValueError, match="more than this model's maximum of 256"):
        embed_llm.embed(long_text)
    (cut,) = embed_llm.embed(long_text, PoolingParams(truncate_prompt_tokens=10))
    cls, sep = cut.prompt_token_ids[0], cut.prompt_token_ids[-1]
    assert len(cut.prompt_token_ids) == 10 and (cls, sep) == (101, 102)
    (full,) = embed_llm.embed(long_text, PoolingParams(truncate_prompt_tokens=-1))
    assert len(full.prompt_token_ids) == 256


@pytest.mark.parametrize(("prompt", "params", "match"), [
    ("", None, "must not be empty"),
    ([], None, "must not be empty"),
    ([5, 999999], None, "token id at index 1"),
    ("hi", PoolingParams(dimensions=385), "dimensions must be at most"),
    ("hi", PoolingParams(dimensions=0), "dimensions must be a positive integer"),
    ("hi", PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ("hi", PoolingParams(truncate_prompt_tokens=1000), "truncate_prompt_tokens 1000"),
])
def test_bad_input_is_a_value_error(embed_llm: LLM, prompt: object,
                                    params: PoolingParams | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        embed_llm.embed(prompt, params)  # type: ignore[arg-type]
    assert not embed_llm.engine.has_unfinished_requests()
    assert len(embed_llm.embed("still fine")[0].embedding) == 384


def test_generation_is_refused_by_an_embedding_engine(embed_llm: LLM) -> None:
    with pytest.raises(ValueError, match="computes embeddings"):
        embed_llm.generate("hello", SamplingParams(max_tokens=2))
    assert not embed_llm.engine.has_unfinished_requests()


def test_no_kv_cache_for_an_encoder(embed_llm: LLM) -> None:
    info = embed_llm.engine.model_info()
    assert info.kv_cache.num_blocks == 0
    assert embed_llm.engine.core.executor.runner.kv_caches == []
