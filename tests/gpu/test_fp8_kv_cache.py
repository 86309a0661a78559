"""--kv-cache-dtype fp8 on a real GPU: e4m3 stores rounded as torch rounds, attention over
the stored values, twice the blocks in the same memory, CUDA graphs giving the eager tokens.
Dummy weights of a preset shape (no model file needed). Skips without CUDA (CI has none) and
on GPUs without fp8 (compute capability below 8.9)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")]


@pytest.mark.parametrize("fp8_compute", ["fp16", "query"])
def test_fp8_store_rounds_as_torch_and_attention_reads_it(fp8_compute: str) -> None:
    """Stores, then bf16 queries over the cache widened to fp16 (the default) or to bf16."""
    from tokenmill.kernels.triton import attention as tk
    from tokenmill.kernels.triton import attention_decode as td

    gen = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, block_size, n = 32, 8, 128, 16, 300
    k, v = (torch.randn(n, hkv, d, generator=gen, device="cuda") * 40 for _ in range(2))
    k[0, 0, :2] = torch.tensor([1000.0, -5000.0])  # clamped to +-448, never NaN
    k, v = k.bfloat16(), v.bfloat16()
    cache = torch.zeros(2, 32, block_size, hkv, d, dtype=torch.float8_e4m3fn, device="cuda")
    slots = torch.randperm(32 * block_size, generator=gen, device="cuda")[:n]
    tk.store_kv(k, v, cache, slots)
    for i, x in enumerate((k, v)):
        want = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        got = cache[i].view(torch.uint8).view(-1, hkv, d)[slots]
        assert torch.equal(got, want.view(torch.uint8))
    # One sequence of n tokens in blocks 0, 1, ...: its last query against the widened cache.
    seq = torch.zeros_like(cache)
    tk.store_kv(k, v, seq, torch.arange(n, device="cuda"))
    table = torch.arange(32, dtype=torch.int32, device="cuda")[None]
    q = torch.randn(1, hq, d, generator=gen, device="cuda").bfloat16()
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    out = td.decode_attention(q, seq, table, lens, d ** -0.5, 512, fp8_compute=fp8_compute)
    assert tk.widens_to_fp16(q, seq, fp8_compute) == (fp8_compute == "fp16")
    kk, vv = (seq[i].view(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, 1)
              for i in range(2))
    probs = (torch.einsum("hd,khd->hk", q[0].float(), kk) * d ** -0.5).softmax(-1)
    ref = torch.einsum("hk,khd->hd", probs, vv)
    assert (out[0].float() - ref).abs().max().item() <= 3e-2 * ref.abs().max().item()


def _engine(kv_cache_dtype: str, enforce_eager: bool = False):  # noqa: ANN202
    from tokenmill import LLM

    return LLM(model="qwen3-0.6b", load_format="dummy", device="cuda", max_model_len=1024,
               max_num_seqs=8, kv_cache_memory_bytes=256 * 2**20, kv_cache_dtype=kv_cache_dtype,
               enforce_eager=enforce_eager)


def test_fp8_engine_doubles_the_blocks_and_graphs_match_eager() -> None:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [[1 + i, 20 + i, 300 + i, 4000 + i] * (8 + 5 * i) for i in range(4)]
    runs = {}
    for name, eager in (("graphs", False), ("eager", True)):
        llm = _engine("fp8", enforce_eager=eager)
        plan = llm.engine.model_info().kv_cache
        outs = llm.generate(prompts, params)
        runs[name] = [o.outputs[0].token_ids for o in outs]
        for o in outs:
            assert all(math.isfinite(lp.logprob) for lp in o.outputs[0].logprobs)
        del llm
    assert runs["graphs"] == runs["eager"]
    bf16 = _engine("auto").engine.model_info().kv_cache
    assert plan.dtype == "float8_e4m3fn" and bf16.dtype == "bfloat16"
    assert 2 * plan.bytes_per_block == bf16.bytes_per_block
    assert plan.num_blocks >= 2 * bf16.num_blocks
