"""quantize_model on tiny random models, and the quantization option's validation."""

from __future__ import annotations

import copy

import pytest
import torch
from quant_helpers import PagedKVCache, logits_of, run_step, tiny_arch, tiny_model
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.models.layers import RotaryEmbedding
from tokenmill.quant import (
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    QuantizedEmbedding,
    QuantizedHead,
    quantize_model,
)
from tokenmill.quant.model import decode_read_bytes, model_weight_bytes

PROMPT = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(1)).tolist()
# method -> (max relative L2 error of the logits, min share of equal argmax tokens)
LIMITS = {"int8": (0.03, 0.95), "int4": (0.1, 0.85)}


def _greedy(model: nn.Module, prompt: list[int], steps: int) -> list[int]:
    cache = PagedKVCache.for_arch(model.config)
    logits = run_step(model, cache, [(0, prompt)])[0][-1]
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = run_step(model, cache, [(0, [out[-1]])])[0][-1]
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_stay_close(method: str, tied: bool) -> None:
    model = tiny_model(tiny_arch(tied=tied))
    ref = logits_of(model, PROMPT)
    summary = quantize_model(model, method)
    out = logits_of(model, PROMPT)
    max_err, min_agree = LIMITS[method]
    assert (out - ref).norm() / ref.norm() < max_err
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= min_agree
    # fused qkv and gate_up included: every projection of both layers
    assert summary.num_quantized == 8 and not summary.kept_float
    cls = Int8WeightOnlyLinear if method == "int8" else Int4WeightOnlyLinear
    layer = model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        assert type(proj) is cls
    head = model.model.embed_tokens if tied else model.lm_head
    assert isinstance(head, QuantizedEmbedding if tied else QuantizedHead)
    assert summary.head == ("int8 (tied embedding)" if tied else "int8")
    # The logits' product was chosen when the head was put in place: the quantized kernel
    h = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(h), head.matrix(h).float())


def test_greedy_decode_mostly_equal() -> None:
    model = tiny_model(tiny_arch(), seed=2)
    ref = _greedy(model, PROMPT[:16], 12)
    for method in ("int8", "int4"):
        quantized = copy.deepcopy(model)
        quantize_model(quantized, method)
        got = _greedy(quantized, PROMPT[:16], 12)
        assert sum(a == b for a, b in zip(got, ref, strict=True)) >= 10, method


def test_bias_memory_and_idempotence() -> None:
    model = tiny_model(tiny_arch("Qwen2ForCausalLM", tied=False))  # q/k/v biases
    ref = logits_of(model, PROMPT)
    float_bytes = quantize_model(model, "none").weight_bytes
    summary = quantize_model(model, "int4", group_size=64)
    assert model.model.layers[1].self_attn.qkv_proj.bias is not None
    assert (logits_of(model, PROMPT) - ref).norm() / ref.norm() < LIMITS["int4"][0]
    assert summary.weight_bytes < float_bytes / 3
    again = quantize_model(model, "int4", group_size=64)
    assert again.num_quantized == 8 and again.weight_bytes == summary.weight_bytes


def test_head_method_and_layers_kept_float() -> None:
    model = tiny_model(tiny_arch())
    model.model.layers[0].mlp.down_proj = nn.Linear(96, 128, bias=False)  # K = 96: not /64
    summary = quantize_model(model, "int4", group_size=64, head_method="none")
    assert "model.layers.0.mlp.down_proj" in summary.kept_float
    assert "group_size 64" in summary.kept_float["model.layers.0.mlp.down_proj"]
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert summary.num_quantized == 7 and summary.head == "float (tied embedding)"
    head4 = tiny_model(tiny_arch())
    assert quantize_model(head4, "int8", head_method="int4").head == "int4 (tied embedding)"


def test_invalid_options_name_the_field() -> None:
    model = tiny_model(tiny_arch())
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(model, "fp4")
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_model(model, "int4", group_size=16)
    with pytest.raises(ValueError, match="head_method must be one of"):
        quantize_model(model, "int8", head_method="int2")
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int3")
    assert ModelConfig(quantization="int4").quantization == "int4"


def test_cli_and_offline_api_take_the_option() -> None:
    from tokenmill import LLM
    from tokenmill.cli import build_parser
    from tokenmill.engine.args import engine_config_from_args

    args = build_parser().parse_args(["generate", "hi", "--quantization", "int8"])
    assert engine_config_from_args(args).model.quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--quantization", "int2"])
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="q4")


def test_fp8_is_refused_where_there_are_no_fp8_matmuls() -> None:
    model = tiny_model(tiny_arch()).to("meta")
    with pytest.raises(ValueError, match="fp8.*compute capability 8.9"):
        quantize_model(model, "fp8")
    assert torch.device("meta") == next(model.parameters()).device


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_decode_read_bytes_leave_out_the_tables_a_step_reads_a_row_of(tied: bool) -> None:
    """The roofline's bytes per token: every tensor but the rotary tables and an untied token
    embedding; a tied one is the head (read whole). Quantized, the head and the layers count
    at their packed size."""
    model = tiny_model(tiny_arch(tied=tied))
    rotary = sum(b.numel() * b.element_size() for m in model.modules()
                 if isinstance(m, RotaryEmbedding) for b in m.buffers())
    embedding = model.model.embed_tokens.weight
    lookup = 0 if tied else embedding.numel() * embedding.element_size()
    assert rotary > 0
    assert decode_read_bytes(model) == model_weight_bytes(model) - rotary - lookup
    quantized = copy.deepcopy(model)
    quantize_model(quantized, "int8")
    assert decode_read_bytes(quantized) < decode_read_bytes(model) / 2
