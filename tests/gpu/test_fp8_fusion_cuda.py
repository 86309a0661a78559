"""On a real GPU: the fp8 activation quantization fused into the norm and SiLU-and-mul kernels
gives the bytes and scales of the unfused path (the kernel's output, then quant/fp8_kernels.py)
in bf16 at Llama-3.1-8B's widths, an fp8 model's hidden states are unchanged by it, and the
residual carry gives the hidden states of the plain formula. Skips without CUDA (CI has none)
and on GPUs without fp8 (compute capability below 8.9)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels.fp8_activation import QuantizedActivation

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")]

sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from paged import PagedKVCache  # noqa: E402
from quant_helpers import tiny_arch, tiny_model  # noqa: E402
from test_residual_carry import old_formula  # noqa: E402

from tokenmill.models.kernel_binding import bind_kernels  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _rows(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, device="cuda") * 3
    x[0, 5] = 300.0  # an outlier sets row 0's scale
    x[2] = 0.0  # an all-zero row: scale 1
    return x.to(dtype)


def _same(got: QuantizedActivation, want_q: torch.Tensor, want_scale: torch.Tensor) -> None:
    assert got.values.dtype == E4M3
    assert torch.equal(got.scale, want_scale)
    assert torch.equal(got.values.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(256, 4096), (3, 4096), (7, 1000), (5, 5120 + 24)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_fp8_gives_the_unfused_bytes(dtype: torch.dtype, rows: int, cols: int,
                                              residual: bool) -> None:
    from tokenmill.kernels.triton import fp8 as fp8_kernels
    from tokenmill.kernels.triton import fused_ops
    from tokenmill.quant.fp8 import FP8_MAX

    x = _rows(rows, cols, dtype, cols)
    res = _rows(rows, cols, dtype, cols + 1) if residual else None
    weight = (torch.rand(cols, device="cuda") + 0.5).to(dtype)
    y, want_sum = fused_ops.rms_norm(x, weight, 1e-5, residual=res)
    got, got_sum = fused_ops.rms_norm_fp8(x, weight, 1e-5, residual=res)
    _same(got, *fp8_kernels.quantize_rows_fp8(y, FP8_MAX))
    assert torch.equal(got_sum, want_sum)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(256, 14336), (1, 14336), (7, 2500), (4, 48)])
def test_silu_and_mul_fp8_gives_the_unfused_bytes(dtype: torch.dtype, rows: int, n: int) -> None:
    from tokenmill.kernels.triton import fp8 as fp8_kernels
    from tokenmill.kernels.triton import fused_ops
    from tokenmill.quant.fp8 import FP8_MAX

    x = _rows(max(rows, 3), 2 * n, dtype, n)[:rows]
    got = fused_ops.silu_and_mul_fp8(x)
    _same(got, *fp8_kernels.quantize_rows_fp8(fused_ops.silu_and_mul(x), FP8_MAX))


def _hidden(model: torch.nn.Module, fn=None) -> list[torch.Tensor]:
    """Hidden states of a prefill step of two sequences and a decode step, on CUDA."""
    arch = model.config
    cache = PagedKVCache(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                         dtype=torch.bfloat16)
    cache.kv_caches = [t.cuda() for t in cache.kv_caches]
    out = []
    for batch in ([(0, [5, 17, 33, 2, 91, 8]), (1, [4, 4, 9])], [(0, [12]), (1, [70])]):
        ids = torch.tensor([t for _, seq in batch for t in seq], device="cuda")
        meta, positions = cache.step([(seq_id, len(seq)) for seq_id, seq in batch])
        meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.cuda(),
                                   query_start_loc=meta.query_start_loc.cuda(),
                                   seq_lens=meta.seq_lens.cuda(),
                                   block_tables=meta.block_tables.cuda())
        with torch.no_grad():
            out.append((fn or model)(ids, positions.cuda(), meta))
    return out


def _bf16_model(arch_name: str) -> torch.nn.Module:
    arch = dataclasses.replace(tiny_arch(arch_name), intermediate_size=2560)  # two passes
    # Moved to the GPU after it was built: its kernels are bound for the GPU here, as
    # create_model binds a model built there.
    return bind_kernels(tiny_model(arch).to("cuda", torch.bfloat16))


@pytest.mark.parametrize("arch_name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_fp8_model_is_unchanged_by_the_fusion(arch_name: str) -> None:
    from tokenmill.quant import quantize_model

    model = _bf16_model(arch_name)
    quantize_model(model, "fp8")
    fused = _hidden(model)
    for layer in model.model.layers:
        assert layer.input_layernorm.fp8_out and layer.mlp.fp8_act
        layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = False
        layer.mlp.fp8_act = False
    unfused = _hidden(model)
    for got, want in zip(fused, unfused, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("arch_name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_residual_carry_is_bit_identical(arch_name: str) -> None:
    model = _bf16_model(arch_name)
    for got, want in zip(_hidden(model), _hidden(model, lambda *a: old_formula(model, *a)),
                         strict=True):
        assert torch.equal(got, want)

