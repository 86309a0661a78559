"""fp8 (e4m3) linear layers: per-channel weights, per-token activations, ``torch._scaled_mm``.

``_scaled_mm`` runs on the CPU too, so the arithmetic is checked here; tests/gpu repeats the
module test on a GPU of compute capability 8.9+.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quant_helpers import PagedKVCache, run_step, tiny_arch, tiny_model

from tokenmill.quant import quantize_model, quantize_weight
from tokenmill.quant.fp8 import FP8_MAX, Fp8Linear, fp8_supported, quantize_fp8
from tokenmill.quant.model import count_parameters

# torch 2.11's CPU _scaled_mm (a GPU image's) takes no per-row scales: the engine refuses fp8
# there with the reason (tested below), and these CPU checks of the arithmetic cannot run.
needs_cpu_fp8 = pytest.mark.skipif(not fp8_supported(torch.device("cpu")),
                                   reason="this torch's CPU _scaled_mm takes no per-row scales")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_weight_quantization_is_per_row_and_within_e4m3_precision() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 1, 64).unsqueeze(1)
    q, scales = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (64,)
    assert torch.allclose(q.float().abs().amax(1), torch.full((64,), FP8_MAX))
    deq = q.float() * scales.unsqueeze(1)
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 per element, and below
    # its smallest normal (2^-6) the subnormals' spacing of 2^-9 (both times the row's scale).
    bound = w.abs() * 2**-4 + scales.unsqueeze(1) * 2**-10
    assert ((deq - w).abs() <= bound * 1.0001).all()


@needs_cpu_fp8
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_float(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=gen)
    b = torch.randn(96, generator=gen)
    x = torch.randn(2, rows, 160, generator=gen).to(dtype)
    m = quantize_weight(w, b, "fp8")
    assert isinstance(m, Fp8Linear)
    y = m(x)
    assert y.shape == (2, rows, 96) and y.dtype == dtype
    # Both operands carry e4m3's ~3% rounding; the product's error is a few percent.
    assert _rel_err(y, F.linear(x.float(), w, b)) < 0.06
    # Against the dequantized weight only the activations' rounding (and bf16 output) remain.
    assert _rel_err(y, F.linear(x.float(), m.dequantize(), b)) < 0.05
    assert torch.equal(m.lookup(torch.tensor([3, 5]), torch.float32), m.dequantize()[[3, 5]])


def test_fp8_refuses_shapes_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear.from_weight(torch.randn(40, 24), None)


def test_fp8_refused_with_the_reason_where_cpu_scaled_mm_takes_no_row_scales(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch whose CPU ``_scaled_mm`` takes one scale a tensor only (2.11), fp8 layers
    and ``quantize_model`` refuse the CPU with the reason, instead of failing in a forward."""
    from tokenmill.quant import fp8

    monkeypatch.setattr(fp8, "_cpu_takes_row_scales", lambda: False)
    with pytest.raises(ValueError, match="CPU _scaled_mm does not take per-row scales"):
        Fp8Linear.from_weight(torch.randn(32, 32), None)
    model = tiny_model(tiny_arch("LlamaForCausalLM"))
    with pytest.raises(ValueError, match="quantization 'fp8' on cpu: this torch's"):
        quantize_model(model, "fp8")


@needs_cpu_fp8
def test_quantize_model_fp8_keeps_the_model_close() -> None:
    arch = tiny_arch()
    ref = tiny_model(arch)
    model = tiny_model(arch)
    summary = quantize_model(model, "fp8")
    assert summary.method == "fp8" and summary.num_quantized == 8
    assert summary.head == "int8 (tied embedding)"  # the CPU's default head
    assert count_parameters(model) == count_parameters(ref)
    assert "fp8" in quantize_model(tiny_model(arch), "fp8", head_method="fp8").head
    tokens = [5, 17, 33, 2, 91, 8]
    logits = {}
    for name, m in (("float", ref), ("fp8", model)):
        cache = PagedKVCache(2, arch.num_key_value_heads, arch.head_dim)
        logits[name] = run_step(m, cache, [(0, tokens)])[0]
    assert _rel_err(logits["fp8"], logits["float"]) < 0.05
    assert torch.equal(logits["fp8"].argmax(-1), logits["float"].argmax(-1))


@needs_cpu_fp8
def test_llm_with_fp8_weights_answers_like_float() -> None:
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    outs = {q: [o.outputs[0].text for o in LLM(quantization=q, num_kv_blocks=64,
                                               max_model_len=256).generate(prompts, params)]
            for q in ("none", "fp8")}
    assert outs["fp8"][0].startswith(" Paris") and outs["none"][0].startswith(" Paris")
    assert outs["fp8"][1][:3] == outs["none"][1][:3]
