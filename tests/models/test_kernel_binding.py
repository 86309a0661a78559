"""Each block's kernels are chosen once, when the model is built (models/kernel_binding.py):
on the CPU PyTorch's, with no device test at call time; bound to the Triton set (run in the
interpreter on CPU tensors) the blocks call its kernels; ``Linear.forward`` gives a tensor."""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
from quant_helpers import PagedKVCache, run_step, tiny_arch, tiny_model  # noqa: E402

from tokenmill.models import kernel_binding as kb  # noqa: E402
from tokenmill.models import linear as lin  # noqa: E402
from tokenmill.models.layers import Attention, GatedMLP, Linear, RMSNorm  # noqa: E402
from tokenmill.models.registry import create_model  # noqa: E402

BATCH = [(0, [5, 17, 33, 2, 91, 8]), (1, [4, 4, 9])]


def _logits(model: torch.nn.Module) -> list[torch.Tensor]:
    arch = model.config
    return run_step(model, PagedKVCache(2, arch.num_key_value_heads, arch.head_dim), BATCH)


def _kernel_functions(model: torch.nn.Module) -> list[object]:
    """Every function a block of ``model`` holds as its kernel."""
    held: list[object] = []
    for m in model.modules():
        for name in ("_product", "_norm", "_norm_linear", "_act", "_act_down", "_qk_norm",
                     "_rotary"):
            if name in vars(m):
                fn = vars(m)[name]
                held.append(fn.func if isinstance(fn, functools.partial) else fn)
    return held


def test_a_cpu_model_is_bound_to_pytorch_kernels_when_built() -> None:
    arch = tiny_arch("Qwen3ForCausalLM")
    model = create_model(arch, torch.float32, "cpu")
    torch_fns = {F.linear, kb.torch_add_rms_norm, kb.norm_then_linear, kb.torch_silu_mul,
                 kb.silu_then_down, kb.torch_qk_norm, kb.torch_rotary}
    held = _kernel_functions(model)
    assert held and set(held) <= torch_fns
    for m in model.modules():
        if isinstance(m, (RMSNorm, GatedMLP)):
            assert m._kernels is kb.TORCH_KERNELS
    assert isinstance(model.model.layers[0].self_attn, Attention)


def test_a_cpu_forward_asks_nothing_of_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks' forward calls its bound kernels: no test of ``is_cuda``, no matmul
    tuning asked, no Triton module imported; and the logits are those of before."""
    model = tiny_model(tiny_arch("Qwen3ForCausalLM"))
    want = _logits(model)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a device test at call time")

    monkeypatch.setattr(lin, "gemm_tile", refuse)
    monkeypatch.setattr(kb, "triton_module", refuse)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(refuse))
    got = _logits(model)
    monkeypatch.undo()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_the_triton_binding_gives_the_blocks_the_triton_kernels() -> None:
    triton = kb.triton_kernels()
    if triton is None:
        pytest.skip("Triton is not installed")
    from tokenmill.kernels.triton import fused_ops

    model = kb.bind_kernels(tiny_model(tiny_arch("Qwen3ForCausalLM")), kernels=triton)
    layer = model.model.layers[0]
    norm = layer.input_layernorm
    assert norm._norm.args == (fused_ops.rms_norm,)
    assert layer.mlp._act.args == (fused_ops.silu_and_mul,)
    assert layer.self_attn._qk_norm.args == (fused_ops.head_rms_norm_,)
    assert layer.self_attn._rotary.args == (fused_ops.rotary_,)
    assert layer.self_attn.qkv_proj._product is kb._tuned_linear
    # The norm computes in its reader's product, the one it was bound for.
    assert norm._norm_linear.args == (layer.self_attn.qkv_proj,)
    assert layer.mlp._act_down.args == (layer.mlp.down_proj,)
    # The quantization pass's flags re-choose the kernel once, not at each call.
    norm.fp8_out = True
    layer.mlp.fp8_act = True
    assert norm._norm.args == (fused_ops.rms_norm_fp8,)
    assert norm._norm_linear is kb.norm_then_linear
    assert layer.mlp._act.args == (fused_ops.silu_and_mul_fp8,)
    norm.fp8_out = False
    assert norm._norm.args == (fused_ops.rms_norm,)
    copied = copy.deepcopy(model).model.layers[0]  # a bound model copies, its binding too
    assert copied.input_layernorm._norm_linear.args == (copied.self_attn.qkv_proj,)
    # Back to PyTorch's.
    kb.bind_kernels(model, "cpu")
    assert norm._norm is kb.torch_add_rms_norm and norm._norm_linear is kb.norm_then_linear


def test_linear_forward_gives_a_tensor_and_a_replaced_reader_gets_the_norm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the tuned products (a GPU's tuning, patched in) the norm's add and the norm run in
    the Linear's kernel, and the Linear's forward still gives one tensor; a layer that took
    the bound Linear's place (a LoRA adapter) gets the norm's output instead."""
    pytest.importorskip("triton")
    from tokenmill.kernels.triton import gemm as fg

    tuned = kb.with_tuned_matmul(kb.TORCH_KERNELS)
    gen = torch.Generator().manual_seed(3)
    rms, layer = RMSNorm(32, 1e-6).half(), Linear(32, 16, bias=False).half()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 32, generator=gen) / 4)
    rms.feeds(layer)
    kb.bind_kernels(rms, kernels=tuned)
    kb.bind_kernels(layer, kernels=tuned)
    tile = fg.GemmTile(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=2)
    monkeypatch.setattr(lin, "gemm_tile", lambda a, n, fp8=False, k=None: tile)
    h, residual = (torch.randn(3, 32, generator=gen).half() for _ in range(2))
    assert isinstance(layer(h), torch.Tensor)
    y, summed = rms.linear_forward(h, residual, layer)
    assert isinstance(y, torch.Tensor) and torch.equal(summed, h + residual)
    seen: list[object] = []
    other = torch.nn.Linear(32, 16, bias=False).half()
    other.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    y2, summed2 = rms.linear_forward(h, residual, other)
    assert isinstance(seen[0], torch.Tensor) and torch.equal(summed2, h + residual)
    assert torch.equal(y2, other(rms(h + residual)))


def test_an_fp8_linear_quantizes_its_input_with_the_bound_kernel() -> None:
    from tokenmill.quant import fp8

    if not fp8.fp8_supported(torch.device("cpu")):
        pytest.skip("this torch's CPU _scaled_mm takes no per-row scales")
    layer = fp8.Fp8Linear.from_weight(torch.randn(32, 64), None)
    assert layer._quantize is fp8.torch_quantize_activation  # chosen for the CPU weight
    triton = kb.triton_kernels()
    if triton is None:
        pytest.skip("Triton is not installed")
    from tokenmill.kernels.triton import fp8 as fp8_kernels

    kb.bind_kernels(layer, kernels=triton)
    assert layer._quantize.args == (fp8_kernels.quantize_rows_fp8,)  # (its bytes: tests/quant/test_fp8_*.py)
    kb.bind_kernels(layer, "cpu")
    assert layer._quantize is fp8.torch_quantize_activation
