"""The fused CUDA elementwise kernels against the PyTorch code of models/layers.py.

Without a GPU they run in Triton's interpreter on CPU tensors (fp32 and fp16; the interpreter
gets bf16 wrong, so bf16 is compared on CUDA only).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tokenmill.kernels.triton import fused_ops  # noqa: E402
from tokenmill.models.layers import RMSNorm, RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 96, 576])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    norm = RMSNorm(cols, 1e-5)
    norm.weight.data = torch.rand(cols, generator=gen) + 0.5
    norm = norm.to(DEVICE, dtype)
    x = torch.randn(5, cols, generator=gen).to(DEVICE, dtype)
    res = torch.randn(5, cols, generator=gen).to(DEVICE, dtype)
    out, same = fused_ops.rms_norm(x, norm.weight, norm.eps)
    _close(out, norm(x), dtype)
    assert same is x
    res_before = res.clone()
    out, summed = fused_ops.rms_norm(x, norm.weight, norm.eps, residual=res)
    _close(summed, x + res, dtype)
    _close(out, norm(x + res), dtype)
    assert torch.equal(res, res_before)  # inputs are left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [48, 1536, 2500])
def test_silu_and_mul(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, 2 * n, generator=gen).to(DEVICE, dtype)
    gate, up = x.split(n, dim=-1)
    _close(fused_ops.silu_and_mul(x), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim", [(12, 64), (5, 80)])
def test_rotary_in_place_on_a_strided_view(dtype: torch.dtype, heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(heads)
    rope = RotaryEmbedding(dim, 512, 10000.0, None).to(DEVICE)
    positions = torch.tensor([0, 7, 300, 511, 3], device=DEVICE)
    fused = torch.randn(5, heads * dim + 32, generator=gen).to(DEVICE, dtype)  # + other columns
    x = fused[:, :heads * dim].view(5, heads, dim)
    cos, sin = rope.cos_sin(positions, dtype)
    want = apply_rotary(x.clone(), cos, sin)
    tail = fused[:, heads * dim:].clone()
    fused_ops.rotary_(x, cos, sin)
    _close(x, want, dtype)
    assert torch.equal(fused[:, heads * dim:], tail)  # nothing outside the view written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,k_heads,dim", [(16, 8, 128), (6, 3, 80), (2, 2, 64)])
def test_head_rms_norm_in_place_on_a_strided_view(dtype: torch.dtype, q_heads: int,
                                                  k_heads: int, dim: int) -> None:
    """Qwen3's per-head norms of q and k, in place on their columns of the fused projection,
    against the layer's PyTorch code (two RMSNorms and a concatenation)."""
    gen = torch.Generator().manual_seed(q_heads * dim)
    norms = []
    for _ in range(2):
        norm = RMSNorm(dim, 1e-6)
        norm.weight.data = torch.rand(dim, generator=gen) + 0.5
        norms.append(norm.to(DEVICE, dtype))
    heads = q_heads + k_heads
    # q, k and v columns of 5 tokens, the v heads after the view; values far from unit scale.
    fused = (3 * torch.randn(5, (heads + k_heads) * dim, generator=gen)).to(DEVICE, dtype)
    qk = fused[:, :heads * dim].view(5, heads, dim)
    want = torch.cat([norms[0](qk[:, :q_heads]), norms[1](qk[:, q_heads:])], dim=1)
    v = fused[:, heads * dim:].clone()
    assert fused_ops.head_rms_norm_(qk, norms[0].weight, norms[1].weight, q_heads,
                                    1e-6) is qk
    _close(qk, want, dtype)
    assert torch.equal(fused[:, heads * dim:], v)  # nothing outside the view written


def test_head_rms_norm_names_what_it_cannot_take() -> None:
    qk = torch.zeros(2, 6, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        fused_ops.head_rms_norm_(qk.transpose(1, 2), w, w, 2, 1e-6)
    with pytest.raises(ValueError, match="7 query heads of 6"):
        fused_ops.head_rms_norm_(qk, w, w, 7, 1e-6)
    with pytest.raises(ValueError, match=r"weights \(4,\)"):
        fused_ops.head_rms_norm_(qk, w[:4], w, 2, 1e-6)
    # No tokens: nothing to launch.
    assert fused_ops.head_rms_norm_(qk[:0], w, w, 2, 1e-6).shape == (0, 6, 8)
    # After the refusals, a valid call is normed as before.
    norm = RMSNorm(8, 1e-6).to(DEVICE)
    qk = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    want = norm(qk)
    _close(fused_ops.head_rms_norm_(qk, norm.weight, norm.weight, 2, 1e-6), want,
           torch.float32)


def test_triton_kernels_only_for_cuda_models() -> None:
    from tokenmill.models.kernel_binding import TORCH_KERNELS, kernels_for

    assert kernels_for("cpu") is TORCH_KERNELS


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs Triton kernels on CPU tensors: interpreter only (on a GPU "
                           "the layers take these paths themselves, tests/gpu)")
@pytest.mark.parametrize("arch_name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_model_with_fused_kernels_matches_eager(monkeypatch: pytest.MonkeyPatch,
                                                arch_name: str) -> None:
    """The layers' fused paths (norms, residual adds, SiLU-and-mul, rotary) give the logits of
    their PyTorch code: the model is bound to the Triton kernels for CPU tensors, in the
    interpreter."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
    from quant_helpers import PagedKVCache, run_step, tiny_arch, tiny_model

    from tokenmill.models.kernel_binding import bind_kernels, triton_kernels

    arch = tiny_arch(arch_name)
    model = tiny_model(arch)
    batch = [(0, [5, 17, 33, 2, 91, 8]), (1, [4, 4, 9])]
    want = run_step(model, PagedKVCache(2, arch.num_key_value_heads, arch.head_dim), batch)
    bind_kernels(model, kernels=triton_kernels())
    got = run_step(model, PagedKVCache(2, arch.num_key_value_heads, arch.head_dim), batch)
    for g, w in zip(got, want, strict=True):
        _close(g.to(DEVICE), w.to(DEVICE), torch.float32)
