"""The layer stack carries the residual stream beside each layer's output and leaves the add to
the next norm's kernel (``DecoderLayer.forward``): the hidden states must be bit-identical to
the plain formula it replaces, ``h = h + mlp(norm(h + attn(norm(h))))`` layer by layer.

On the CPU in PyTorch ops (fp32, bf16) and with the layers' Triton kernels forced on for CPU
tensors in the interpreter (fp32, fp16: the interpreter gets bf16 wrong).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from paged import PagedKVCache

sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
from quant_helpers import tiny_arch, tiny_model  # noqa: E402

from tokenmill.attention.metadata import AttentionMetadata  # noqa: E402


@torch.no_grad()
def old_formula(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
    """The hidden states as the layers computed them before the residual carry."""
    cos, sin = model.rotary.cos_sin(positions, model.model.norm.weight.dtype)
    h = model.model.embed_tokens(input_ids)
    for layer in model.model.layers:
        attn = layer.self_attn(layer.input_layernorm(h), cos, sin, meta)
        x, h = layer.post_attention_layernorm.add_forward(attn, h)
        h = h + layer.mlp(x)
    return model.model.norm(h)


def _steps(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """A prefill step of two sequences then a decode step, both ways on copies of one cache."""
    arch = model.config
    new = PagedKVCache(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                       dtype=dtype)
    old = new.clone()
    for batch in ([(0, [5, 17, 33, 2, 91, 8]), (1, [4, 4, 9])], [(0, [12]), (1, [70])]):
        ids = torch.tensor([t for _, seq in batch for t in seq])
        chunks = [(seq_id, len(seq)) for seq_id, seq in batch]
        meta, positions = new.step(chunks)
        with torch.no_grad():
            got = model(ids, positions, meta)
        meta, positions = old.step(chunks)
        want = old_formula(model, ids, positions, meta)
        assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("arch_name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_carry_is_bit_identical_in_pytorch_ops(arch_name: str,
                                                        dtype: torch.dtype) -> None:
    _steps(tiny_model(tiny_arch(arch_name)).to(dtype), dtype)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs Triton kernels on CPU tensors: interpreter only (tests/gpu has "
                           "the CUDA check)")
@pytest.mark.parametrize("arch_name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_residual_carry_is_bit_identical_with_the_fused_kernels(
        arch_name: str, dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    from tokenmill.models.kernel_binding import bind_kernels, triton_kernels

    model = tiny_model(tiny_arch(arch_name)).to(dtype)
    bind_kernels(model, kernels=triton_kernels())
    _steps(model, dtype)
