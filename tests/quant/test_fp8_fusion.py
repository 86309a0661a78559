"""fp8 activation quantization fused into the kernels that produce the activations (the
layers' RMSNorms and SiLU-and-mul, models/fused_ops.py) against the unfused path: the same
kernel's output quantized by quant/fp8_kernels.py, byte for byte.

Without a GPU the kernels run in Triton's interpreter on CPU tensors, fp32 and fp16 (the
interpreter gets bf16 wrong; tests/gpu covers it). The interpreter's own e4m3 cast rounds
wrongly at powers of two (see test_fp8_kernels.py), so the values are compared both before the
cast (fp32 output) and after it (e4m3, the same wrong cast on both paths); on CUDA the output is
e4m3, cast by the hardware.
"""

from __future__ import annotations

import os

import pytest
import torch
from quant_helpers import PagedKVCache, run_step, tiny_arch, tiny_model

pytest.importorskip("triton")

from tokenmill.kernels.triton import fp8 as fp8_kernels  # noqa: E402
from tokenmill.kernels.triton import fused_ops  # noqa: E402
from tokenmill.models.kernel_binding import bind_kernels, triton_kernels  # noqa: E402
from tokenmill.quant import fp8, quantize_model  # noqa: E402
from tokenmill.quant.fp8 import FP8_MAX  # noqa: E402
from tokenmill.quant.model import fuse_fp8_inputs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
OUTS = [torch.float8_e4m3fn] + ([torch.float32] if DEVICE.type == "cpu" else [])
# The kernels forced on for CPU tensors need the interpreter (there is none with a GPU).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs Triton kernels on CPU tensors: interpreter only")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _rows(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with an outlier in row 0 and all-zero row 2."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=DEVICE) * 3
    x[0, 5] = 40.0
    x[2] = 0.0
    return x.to(dtype)


def _same(got: fp8.QuantizedActivation, want_q: torch.Tensor, want_scale: torch.Tensor,
          dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.values.dtype == want_q.dtype
    assert torch.equal(got.scale, want_scale)
    assert torch.equal(_bits(got.values), _bits(want_q))
    assert got.scale[2].item() == 1.0  # the all-zero row
    assert not torch.isnan(got.values.float()).any()


@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 200, 1000])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_fp8_gives_the_unfused_bytes(out: torch.dtype, dtype: torch.dtype, cols: int,
                                              residual: bool) -> None:
    x = _rows((5, cols), dtype, cols)
    res = _rows((5, cols), dtype, cols + 1) if residual else None
    gen = torch.Generator(device=DEVICE).manual_seed(cols)
    weight = (torch.rand(cols, generator=gen, device=DEVICE) + 0.5).to(dtype)
    y, want_sum = fused_ops.rms_norm(x, weight, 1e-5, residual=res)
    want_q, want_scale = fp8_kernels.quantize_rows_fp8(y, FP8_MAX, out)
    got, got_sum = fused_ops.rms_norm_fp8(x, weight, 1e-5, residual=res, out_dtype=out)
    _same(got, want_q, want_scale, dtype)
    assert torch.equal(got_sum, want_sum)


@pytest.mark.parametrize("out", OUTS)
@pytest.mark.parametrize("dtype", DTYPES)
# Up to 16,384 columns a row is read once; 16,400 takes the two passes over blocks of 2,048.
@pytest.mark.parametrize("n", [48, 200, 2500, 16400])
def test_silu_and_mul_fp8_gives_the_unfused_bytes(out: torch.dtype, dtype: torch.dtype,
                                                  n: int) -> None:
    x = _rows((4, 2 * n), dtype, n)
    x[1, :n] = 0.0  # a zero gate: a zero row too, whatever up holds
    want_q, want_scale = fp8_kernels.quantize_rows_fp8(fused_ops.silu_and_mul(x), FP8_MAX, out)
    got = fused_ops.silu_and_mul_fp8(x, out_dtype=out)
    _same(got, want_q, want_scale, dtype)
    assert got.scale[1].item() == 1.0


def test_no_rows() -> None:
    got = fused_ops.silu_and_mul_fp8(torch.zeros(0, 64, device=DEVICE))
    assert got.values.shape == (0, 32) and got.scale.shape == (0, 1)


def test_fp8_linear_takes_a_quantized_activation() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = fp8.Fp8Linear.from_weight(torch.randn(48, 64, generator=gen).to(DEVICE),
                                       torch.randn(48, device=DEVICE))
    x = torch.randn(2, 3, 64, generator=gen).to(DEVICE)
    act = fp8.quantize_activation(x.reshape(6, 64))
    assert torch.equal(linear(act).view(2, 3, 48), linear(x))


def _fp8_model(arch_name: str) -> torch.nn.Module:
    model = tiny_model(tiny_arch(arch_name))
    quantize_model(model, "fp8")
    return model


def _set_fusion(model: torch.nn.Module, on: bool) -> None:
    for layer in model.model.layers:
        layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = on
        layer.mlp.fp8_act = on


@interpreted
@pytest.mark.parametrize("arch_name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_fp8_model_outputs_are_unchanged_by_the_fusion(monkeypatch: pytest.MonkeyPatch,
                                                       arch_name: str) -> None:
    """The fp8 model with every kernel on (in the interpreter, for CPU tensors): the fused
    quantization gives the logits of the unfused one exactly."""
    model = _fp8_model(arch_name)
    assert model.model.layers[0].input_layernorm.fp8_out  # set by quantize_model
    assert not model.model.norm.fp8_out  # the head reads the final norm, in float
    arch = model.config
    batch = [(0, [5, 17, 33, 2, 91, 8]), (1, [4, 4, 9])]

    def logits() -> list[torch.Tensor]:
        return run_step(model, PagedKVCache(2, arch.num_key_value_heads, arch.head_dim), batch)

    cpu = logits()  # kernels off: the flags change nothing
    _set_fusion(model, False)
    assert all(torch.equal(a, b) for a, b in zip(logits(), cpu, strict=True))
    bind_kernels(model, kernels=triton_kernels())
    unfused = logits()
    _set_fusion(model, True)
    fused = logits()
    for got, want in zip(fused, unfused, strict=True):
        assert torch.equal(got, want)


def test_fusion_only_where_the_reader_is_fp8() -> None:
    model = tiny_model(tiny_arch())
    quantize_model(model, "int8")
    assert fuse_fp8_inputs(model) == 0
    model = _fp8_model("LlamaForCausalLM")
    assert fuse_fp8_inputs(model) == 3 * len(model.model.layers)
    layer = model.model.layers[1]
    layer.mlp.down_proj = torch.nn.Linear(layer.mlp.intermediate_size, 128)  # kept in float
    assert fuse_fp8_inputs(model) == 3 * len(model.model.layers) - 1
    assert not layer.mlp.fp8_act and layer.post_attention_layernorm.fp8_out
