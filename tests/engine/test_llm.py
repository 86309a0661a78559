"""The whole engine on the embedded SmolLM2: parity with transformers, batching, preemption."""

from __future__ import annotations

import pytest
import torch
from engine_workload import MIXED_PROMPTS as MIXED

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
    "The theory of relativity says that",
]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers_generate(llm: LLM, hf_smollm) -> None:
    tok = llm.get_tokenizer()
    ours = llm.generate(PROMPTS, greedy(64, min_tokens=64))
    for prompt, out in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        ref = hf_smollm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=64, min_new_tokens=64)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
        assert out.outputs[0].finish_reason == "length"


def test_batch_of_16_equals_each_alone(llm: LLM) -> None:
    params = greedy(24)
    batched = tokens(llm.generate(MIXED, params))
    alone = [tokens(llm.generate(p, params))[0] for p in MIXED]
    assert batched == alone


def test_preemption_under_a_small_kv_cache(llm: LLM) -> None:
    params = greedy(48, ignore_eos=True)
    prompts = MIXED[:8]
    expected = tokens(llm.generate(prompts, params))
    # 8 requests need up to ~70 tokens each; 20 blocks of 16 tokens hold ~4 of them.
    small = LLM(dtype="float32", max_model_len=256, num_kv_blocks=20, max_num_batched_tokens=128,
                quantization="none")
    got = tokens(small.generate(prompts, params))
    assert small.engine.core.scheduler.num_preemptions_total > 0
    assert got == expected
    assert small.engine.core.scheduler.kv.usage == 0.0


def test_request_that_can_never_fit_is_an_error_not_a_hang() -> None:
    small = LLM(dtype="float32", max_model_len=512, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV cache"):
        small.generate("Hello", greedy(200))
    with pytest.raises(ValueError, match="max_model_len"):
        small.generate(list(range(600)), greedy(4))
    assert small.generate("Hello", greedy(4))[0].outputs[0].token_ids


def test_chunked_prefill_gives_the_same_logits(llm: LLM) -> None:
    prompt = list(range(1000, 2000))  # 1000 tokens

    def prompt_logits(max_batched: int) -> torch.Tensor:
        engine = LLM(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=128 << 20,
                     max_num_batched_tokens=max_batched, quantization="none")
        model = engine.engine.core.executor.runner.model
        captured: list[torch.Tensor] = []
        original = model.compute_logits

        def capture(hidden: torch.Tensor, **kwargs: bool) -> torch.Tensor:
            logits = original(hidden, **kwargs)
            captured.append(logits)
            return logits

        model.compute_logits = capture
        engine.generate([prompt], greedy(1, prompt_logprobs=0))
        return torch.cat(captured)

    whole = prompt_logits(1024)
    chunked = prompt_logits(64)
    assert whole.shape == chunked.shape == (1000, 49152)
    assert (whole - chunked).abs().max().item() <= 1e-4


def test_seeded_sampling(llm: LLM) -> None:
    def sample(seed: int | None, **kw: object) -> list[int]:
        p = SamplingParams(temperature=1.0, max_tokens=24, seed=seed, **kw)  # type: ignore[arg-type]
        return llm.generate("Tell me a story.", p)[0].outputs[0].token_ids

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    # The seed stream does not depend on batch mates.
    p = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    mates = [SamplingParams(temperature=1.0, max_tokens=30)] * 3
    outs = llm.generate(["Hi", "Tell me a story.", "Hello", "Why?"], [mates[0], p, *mates[1:]])
    assert outs[1].outputs[0].token_ids == first
    top1 = llm.generate(PROMPTS[:2], SamplingParams(top_k=1, max_tokens=16, seed=3))
    assert tokens(top1) == tokens(llm.generate(PROMPTS[:2], greedy(16)))


def test_stop_string_across_tokens(llm: LLM) -> None:
    full = llm.generate(PROMPTS[2], greedy(40, ignore_eos=True))[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in full.token_ids]
    # A stop string made of the end of one token and the start of the next.
    k = next(i for i in range(3, len(pieces) - 1)
             if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    cut = full.text.index(stop)
    out = llm.generate(PROMPTS[2], greedy(40, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == full.text[:cut]
    kept = llm.generate(PROMPTS[2], greedy(40, ignore_eos=True, stop=[stop],
                                           include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:cut + len(stop)]


def test_n_logprobs_and_metrics(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1, logprobs=2,
                            prompt_logprobs=1)
    out = llm.generate("Hello there", params)[0]
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        for lp, t in zip(c.logprobs, c.token_ids, strict=True):
            assert lp.token_id == t and lp.logprob <= 0 and len(lp.top) == 2
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time  # type: ignore[operator]


def test_chat_uses_the_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Say hello."}], greedy(16))[0]
    assert out.prompt is not None and "<|im_start|>assistant" in out.prompt
    assert out.outputs[0].text.strip()
    many = llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]],
                    greedy(4))
    assert len(many) == 2


def test_bad_input_is_rejected_and_the_engine_goes_on(llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("Hi", SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="token id"):
        llm.generate([[1, 2, 10**6]], greedy(4))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("Hi", SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy(4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hi", greedy(4))[0].outputs[0].token_ids


def test_abort_frees_everything(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("to-abort", "Tell me everything about the sea.", greedy(200))
    engine.step()
    final = engine.abort_request("to-abort")
    assert final is not None and final.finished
    assert final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    engine.step()
    assert engine.core.scheduler.kv.usage == 0.0


def test_model_info_walks_the_modules_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ollama routes ask for the model's figures with each request: the walks over its
    modules (parameters, weight bytes, bytes a decode step reads) run once per engine."""
    import tokenmill.executor.base as executor  # the executor walks them, for the core

    walks = []
    for name in ("count_parameters", "model_weight_bytes", "decode_read_bytes"):
        fn = getattr(executor, name)
        monkeypatch.setattr(executor, name,
                            lambda m, fn=fn, name=name: walks.append(name) or fn(m))
    llm = LLM(model="tiny-llama", load_format="dummy", device="cpu")
    first = llm.engine.model_info()
    assert llm.engine.model_info() == first
    assert sorted(walks) == ["count_parameters", "decode_read_bytes", "model_weight_bytes"]
    assert first.num_parameters > 0 and 0 < first.decode_read_bytes <= first.weight_bytes


def test_compute_logits_in_the_heads_dtype() -> None:
    """The logits of a bf16 model: fp32 by default, bf16 when asked (the CUDA runner's step
    hands those to the greedy kernel), the same values."""
    llm = LLM(model="tiny-llama", load_format="dummy", device="cpu", dtype="bfloat16")
    model = llm.engine.core.executor.runner.model
    hidden = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    want = model.compute_logits(hidden)
    got = model.compute_logits(hidden, float32=False)
    assert want.dtype == torch.float32 and got.dtype == torch.bfloat16
    assert torch.equal(got.float(), want)
