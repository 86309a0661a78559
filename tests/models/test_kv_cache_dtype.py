"""A KV cache stored narrower than the activations (fp16 / bf16 under fp32): model.forward and
the C++ decode stack (fp16) write and read it alike, and it stays close to an fp32 cache."""

from __future__ import annotations

import argparse

import pytest
import torch
from hf_checkpoints import Checkpoint
from paged import PagedKVCache
from test_fused_decode import DECODE_STEPS, PROMPT_LENS, decode_both, prefill, quantized_copy

from tokenmill.config import CacheConfig
from tokenmill.engine.args import add_engine_args, engine_config_from_args
from tokenmill.runner.cpu_program import CpuProgram, fused_cache_dtype_ok
from tokenmill.runner.platform import Platform

NARROW = [torch.float16, torch.bfloat16]


def test_fused_stack_matches_model_forward(checkpoint: Checkpoint) -> None:
    cache_dtype = torch.float16
    model, arch = checkpoint.model, checkpoint.arch
    fused = CpuProgram(model)
    cache = PagedKVCache.for_arch(arch, num_blocks=48, dtype=cache_dtype)
    prefill(model, cache, PROMPT_LENS, arch.vocab_size)
    other = cache.clone()
    gen = torch.Generator().manual_seed(1)
    for _ in range(DECODE_STEPS):
        tokens = torch.randint(0, arch.vocab_size, (len(PROMPT_LENS),), generator=gen).tolist()
        want, got = decode_both(model, fused, cache, other, tokens)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # Both wrote the same keys and values, in the cache's dtype: a last-bit difference of the
    # fp32 k before rounding may move one stored value by one unit of fp16.
    for c_e, c_f in zip(cache.kv_caches, other.kv_caches, strict=True):
        assert c_f.dtype == cache_dtype
        torch.testing.assert_close(c_f.float(), c_e.float(), rtol=2.0 ** -10, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", NARROW, ids=["fp16", "bf16"])
def test_close_to_an_fp32_cache(llama: Checkpoint, cache_dtype: torch.dtype) -> None:
    """Same prefill and decode steps over an fp32 cache and a narrow one (model.forward): the
    hidden states differ by about the narrow format's rounding, not more."""
    model, arch = llama.model, llama.arch
    caches = [PagedKVCache.for_arch(arch, num_blocks=48, dtype=d)
              for d in (torch.float32, cache_dtype)]
    for c in caches:
        prefill(model, c, PROMPT_LENS, arch.vocab_size)
    for step in range(DECODE_STEPS):
        tokens = torch.tensor([step + 3, 5, 6, 7, 8])
        outs = []
        for c in caches:
            meta, pos = c.step([(i, 1) for i in range(len(PROMPT_LENS))])
            with torch.inference_mode():
                outs.append(model(tokens, pos, meta))
        ref, got = outs
        rel = ((got - ref).norm() / ref.norm()).item()
        assert 0 < rel < (2e-3 if cache_dtype == torch.float16 else 2e-2), rel


def test_quantized_model_fused_on_fp16_cache(llama: Checkpoint) -> None:
    """The engine's default for a quantized model on the CPU: int4 projections, fp16 cache."""
    pytest.importorskip("tokenmill.quant.linear")
    model = quantized_copy(llama.model, "int4")
    fused = CpuProgram(model)
    arch = llama.arch
    cache = PagedKVCache.for_arch(arch, num_blocks=48, dtype=torch.float16)
    prefill(model, cache, PROMPT_LENS, arch.vocab_size)
    other = cache.clone()
    for step in range(DECODE_STEPS):
        want, got = decode_both(model, fused, cache, other, [step, 5, 6, 7, 8])
        torch.testing.assert_close(got, want, rtol=0, atol=5e-2)


def test_cache_dtypes_the_fused_stack_reads() -> None:
    assert fused_cache_dtype_ok(torch.float32, torch.float32)
    assert fused_cache_dtype_ok(torch.float16, torch.float32)
    assert fused_cache_dtype_ok(torch.bfloat16, torch.bfloat16)
    assert not fused_cache_dtype_ok(torch.bfloat16, torch.float32)  # model.forward runs these
    assert not fused_cache_dtype_ok(torch.float16, torch.bfloat16)
    assert not fused_cache_dtype_ok(torch.float32, torch.bfloat16)


def test_auto_resolution() -> None:
    cpu = Platform(torch.device("cpu"))
    assert cpu.resolve_kv_cache_dtype("auto", torch.float32, quantized=True) == torch.float16
    assert cpu.resolve_kv_cache_dtype("auto", torch.float32, quantized=False) == torch.float32
    assert cpu.resolve_kv_cache_dtype("auto", torch.bfloat16, quantized=True) == torch.bfloat16
    assert cpu.resolve_kv_cache_dtype("float32", torch.float32, quantized=True) == torch.float32
    assert cpu.resolve_kv_cache_dtype("bfloat16", torch.float32, quantized=False) == torch.bfloat16
    cuda = Platform(torch.device("cuda"))
    assert cuda.resolve_kv_cache_dtype("auto", torch.bfloat16, quantized=True) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype 'float16' differs"):
        cuda.resolve_kv_cache_dtype("float16", torch.bfloat16, quantized=False)


def test_fp8_cache_needs_a_gpu_with_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 (e4m3) is read by the Triton kernels only: refused on the CPU and on GPUs older
    than compute capability 8.9, with the reason."""
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' needs a CUDA GPU"):
        Platform(torch.device("cpu")).resolve_kv_cache_dtype("fp8", torch.float32, True)
    cuda = Platform(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for name in ("fp8", "fp8_e4m3"):
        assert cuda.resolve_kv_cache_dtype(name, torch.bfloat16, False) == torch.float8_e4m3fn
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9 or later.*this one is 8.0"):
        cuda.resolve_kv_cache_dtype("fp8", torch.bfloat16, False)


def test_fp8_cache_needs_the_triton_backend(llama: Checkpoint) -> None:
    """Past the platform's check (a GPU without Triton would get here), the runner refuses an
    fp8 cache its attention backend cannot read."""
    from tokenmill.runner.model_runner import ModelRunner

    with pytest.raises(ValueError, match="fp8 KV cache is read by the Triton.*backend is 'cpu'"):
        ModelRunner(llama.model, llama.arch, Platform(torch.device("cpu")), torch.float32, 16,
                    frozenset(), kv_dtype=torch.float8_e4m3fn)


def test_bad_value_is_named() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32.*fp8"):
        CacheConfig(kv_cache_dtype="int8")


def test_cli_option() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-dtype", "bfloat16"])
    assert engine_config_from_args(args).cache.kv_cache_dtype == "bfloat16"
    assert parser.parse_args([]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])


def test_engine_default_and_override(llm) -> None:  # noqa: ANN001 (session fixture)
    """The embedded model quantized (the default) stores fp16, in half the bytes a block of
    the fp32 cache takes; unquantized it stays fp32 (the session's engine); an explicit
    choice wins; the two caches' greedy answers agree on a short prompt."""
    from tokenmill import LLM, SamplingParams

    fp32_plan = llm.engine.model_info().kv_cache
    assert fp32_plan.dtype == "float32"
    quantized = LLM(max_model_len=512, kv_cache_memory_bytes=32 << 20)
    plan = quantized.engine.model_info().kv_cache
    assert plan.dtype == "float16" and "in float16" in plan.describe()
    assert plan.bytes_per_block * 2 == fp32_plan.bytes_per_block
    pinned = LLM(max_model_len=512, kv_cache_memory_bytes=32 << 20, kv_cache_dtype="float32")
    assert pinned.engine.model_info().kv_cache.dtype == "float32"
    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = "The capital of France is"
    got = quantized.generate([prompt], params)[0].outputs[0].token_ids
    want = pinned.generate([prompt], params)[0].outputs[0].token_ids
    assert got == want
