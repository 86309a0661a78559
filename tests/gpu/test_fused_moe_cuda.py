"""The fused-MoE Triton kernel compiled on a real GPU, in bf16 (the interpreter gets bf16 wrong)
at the shapes of Qwen3-30B-A3B's and Mixtral-8x7B's MoE layers, against a loop over the
experts in fp32; and run inside a CUDA graph, which it allows (no value read back to the
host). Skips without CUDA (CI has none); tests/unit/test_fused_moe_triton.py covers the
same kernel in the interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
triton = pytest.importorskip("triton")

# (experts, top-k, hidden, intermediate): Qwen3-30B-A3B's layer, Mixtral-8x7B's.
QWEN3_MOE = (128, 8, 2048, 768)
MIXTRAL = (8, 2, 4096, 14336)


def _layer(shape: tuple[int, int, int, int], seed: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    experts, _, hidden, inter = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device="cuda") / inter ** 0.5
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def _step(tokens: int, shape: tuple[int, int, int, int], seed: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    experts, k, hidden, _ = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return x, weights / weights.sum(dim=-1, keepdim=True), ids


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Each expert's tokens through its gated MLP in fp32, weighted, added to their rows."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel():
            gate, up = (x[tok].float() @ w13[e].float().T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2[e].float().T
            out.index_add_(0, tok, y * topk_weights[tok, slot, None])
    return out


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("shape,tokens", [(QWEN3_MOE, 1), (QWEN3_MOE, 7), (QWEN3_MOE, 256),
                                          (QWEN3_MOE, 2048), (MIXTRAL, 1), (MIXTRAL, 300)])
def test_matches_a_loop_over_experts_in_bf16(shape: tuple[int, int, int, int],
                                             tokens: int) -> None:
    from tokenmill.kernels.triton import fused_moe as fm

    w13, w2 = _layer(shape, 0)
    x, weights, ids = _step(tokens, shape, tokens)
    got = fm.fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert _err(got, reference_moe(x, w13, w2, weights, ids)) < 1.6e-2
    # No atomics: the same step gives the same bytes.
    assert torch.equal(fm.fused_moe(x, w13, w2, weights, ids), got)


def test_runs_in_a_cuda_graph() -> None:
    """Captured once, replayed with another step's tokens and routing copied in: the grouping
    by expert is redone on the device, as eager computes it."""
    from tokenmill.kernels.triton import fused_moe as fm

    w13, w2 = _layer(QWEN3_MOE, 1)
    x, weights, ids = _step(16, QWEN3_MOE, 1)
    fm.fused_moe(x, w13, w2, weights, ids)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w13, w2, weights, ids)
    for seed in (2, 3):
        x2, weights2, ids2 = _step(16, QWEN3_MOE, seed)
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        torch.testing.assert_close(out, fm.fused_moe(x2, w13, w2, weights2, ids2))


@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("tokens", [1, 256])
def test_quantized_experts_in_bf16(wdtype: torch.dtype, tokens: int) -> None:
    """int8 or e4m3 experts with a scale a row, widened to bf16 in the kernel, against their
    dequantized weights."""
    from tokenmill.kernels.triton import fused_moe as fm

    if wdtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs compute capability 8.9 or later")
    w13, w2 = _layer(QWEN3_MOE, 4)
    (q13, s13), (q2, s2) = fm.quantize_experts(w13, wdtype), fm.quantize_experts(w2, wdtype)
    x, weights, ids = _step(tokens, QWEN3_MOE, tokens)
    got = fm.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    want = reference_moe(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights,
                         ids)
    assert got.dtype == torch.bfloat16 and _err(got, want) < 1.6e-2


@pytest.mark.parametrize("tokens", [1, 32, 128])
@pytest.mark.parametrize("block_m", [16, 64])
def test_the_grouping_kernel_gives_the_pytorch_ops_result(tokens: int, block_m: int) -> None:
    """One program's grouping (the compiled histogram, sort and block-wide barrier) against
    PyTorch ops', for 128 experts."""
    from tokenmill.kernels.triton import moe_align

    _, _, ids = _step(tokens, QWEN3_MOE, tokens)
    got = moe_align.align_to_blocks(ids, 128, block_m, in_kernel=True)
    want = moe_align.align_to_blocks(ids, 128, block_m, in_kernel=False)
    for name in ("sorted_ids", "expert_ids", "total"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
