"""The Triton matmul (tokenmill/kernels/triton/gemm.py), fp8 and 16-bit, against the products
it replaces, and the tuning that picks it per GPU and shape. Without a GPU the kernel runs in
Triton's interpreter on CPU tensors, with fp32 or fp16 outputs (the interpreter gets bf16
wrong); on CUDA it is checked against ``torch._scaled_mm`` and ``F.linear`` in bf16."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from tokenmill.kernels.triton import gemm as fg  # noqa: E402
from tokenmill.models import linear as lin  # noqa: E402
from tokenmill.models.kernel_binding import (  # noqa: E402
    TORCH_KERNELS,
    bind_kernels,
    kernels_for,
    with_tuned_matmul,
)
from tokenmill.models.layers import Linear  # noqa: E402
from tokenmill.quant import fp8  # noqa: E402
from tokenmill.quant.fp8 import FP8_MAX, Fp8Linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OUT = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale_a = torch.rand(m, 1, generator=gen) / 100 + 1e-3
    scale_b = torch.rand(1, n, generator=gen) / 100 + 1e-3
    bias = torch.randn(n, generator=gen)
    return tuple(t.to(DEVICE) for t in (a, b, scale_a, scale_b, bias))


@pytest.mark.parametrize("m,n,k,tile", [
    (1, 48, 96, fg.GemmTile(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=2)),
    (70, 48, 80, fg.GemmTile(block_m=32, block_n=16, block_k=32, group_m=2)),  # K masked
    (33, 40, 64, fg.GemmTile(block_m=16, block_n=32, block_k=64, group_m=3)),  # N masked
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_matches_the_scaled_product(m: int, n: int, k: int, tile: fg.GemmTile,
                                              with_bias: bool) -> None:
    a, b, scale_a, scale_b, bias = _operands(m, n, k, m + n + k)
    bias = bias if with_bias else None
    got = fg.scaled_mm(a, scale_a, b, scale_b, bias, OUT, tile)
    want = (a.float() @ b.float().T) * scale_a * scale_b + (0 if bias is None else bias)
    assert got.dtype == OUT and got.shape == (m, n)
    tol = 1e-5 if OUT == torch.float32 else 1e-2
    assert ((got.float() - want).norm() / want.norm()).item() <= tol
    if DEVICE.type == "cuda":
        ref = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=OUT,
                               bias=None if bias is None else bias.to(OUT))
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() <= 1e-2


# The 16-bit products: fp16 in the interpreter, bf16 on a GPU.
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16


@pytest.mark.parametrize("m,n,k,tile", [
    (1, 48, 96, fg.GemmTile(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=2)),
    (3, 40, 80, fg.GemmTile(block_m=16, block_n=32, block_k=64)),  # N and K masked
    (17, 48, 64, fg.GemmTile(block_m=16, block_n=16, block_k=64, group_m=2)),  # two row tiles
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_matches_linear(m: int, n: int, k: int, tile: fg.GemmTile,
                               with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    a, b = (torch.randn(*shape, generator=gen).to(HALF).to(DEVICE) for shape in ((m, k), (n, k)))
    bias = torch.randn(n, generator=gen).to(HALF).to(DEVICE) if with_bias else None
    got = fg.matmul(a, b, bias, tile)
    want = F.linear(a.float(), b.float(), None if bias is None else bias.float())
    assert got.dtype == HALF and got.shape == (m, n)
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2

# The kernels a model on a GPU is bound to; on the CPU, PyTorch's with the products of
# models/linear.py (whose tuning the tests patch in): the paths a GPU takes for its products.
TUNED = kernels_for(DEVICE) if DEVICE.type == "cuda" else with_tuned_matmul(TORCH_KERNELS)

def test_matmul_checks_its_operands() -> None:
    a = torch.zeros(2, 32, dtype=HALF, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        fg.matmul(a, a.float(), None, fg.GemmTile())
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[N, K\]"):
        fg.matmul(a, a[:, :16], None, fg.GemmTile())
    # The next product of valid operands is computed as before.
    b = torch.eye(32, dtype=HALF, device=DEVICE)
    x = torch.arange(64, dtype=torch.float32).view(2, 32).to(HALF).to(DEVICE)
    assert torch.equal(fg.matmul(x, b, None, fg.GemmTile(16, 16, 32, 1, 2, 2)), x)


def test_linear_layers_run_the_tuned_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the tuning gives a tile for a 16-bit product (on a GPU; patched in here), a
    Linear layer's product and the head's are the Triton kernel's, asked with the rows and
    the weight's shape; fp32 products, and tiles of None, go to F.linear."""
    gen = torch.Generator().manual_seed(4)
    layer = bind_kernels(Linear(64, 48, bias=True).to(HALF).to(DEVICE), kernels=TUNED)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen))
        layer.bias.copy_(torch.randn(48, generator=gen))
    x = torch.randn(3, 64, generator=gen).to(HALF).to(DEVICE)
    asked: list[tuple[int, int, int, bool]] = []
    tile = fg.GemmTile(block_m=16, block_n=16, block_k=32, num_warps=2, num_stages=2)

    def gemm_tile(a: torch.Tensor, n: int, fp8: bool = False,
                  k: int | None = None) -> fg.GemmTile | None:
        asked.append((a.shape[0], n, a.shape[1] if k is None else k, fp8))
        return tile if a.shape[0] < 4 else None

    monkeypatch.setattr(lin, "gemm_tile", gemm_tile)
    launched: list[fg.GemmTile] = []
    matmul = fg.matmul
    monkeypatch.setattr(fg, "matmul", lambda *args: launched.append(args[-1]) or matmul(*args))
    got = layer(x)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2
    assert asked == [(3, 48, 64, False)] and launched == [tile]
    layer(torch.randn(5, 64, generator=gen).to(HALF).to(DEVICE))  # no tile: F.linear
    layer.float()(x.float())  # fp32: F.linear, the tuning not asked
    assert len(asked) == 2 and launched == [tile]


def count_matmuls(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The 16-bit Triton matmuls launched from now on, each as its prologue: "silu", "norm"
    (with a residual: "add+norm") or None."""
    launches: list[str | None] = []
    matmul = fg.matmul

    def counted(*args: object, silu_mul: bool = False,
                norm: fg.NormPrologue | None = None) -> torch.Tensor:
        launches.append("silu" if silu_mul else None if norm is None else
                        "norm" if norm.residual is None else "add+norm")
        return matmul(*args, silu_mul=silu_mul, norm=norm)  # type: ignore[arg-type]

    monkeypatch.setattr(fg, "matmul", counted)
    return launches


@pytest.mark.parametrize("m,n,k,tile", [
    (1, 48, 96, fg.GemmTile(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=2)),
    (5, 40, 80, fg.GemmTile(block_m=16, block_n=32, block_k=64)),  # N and K masked
])
def test_matmul_with_the_silu_prologue_equals_the_two_kernels(m: int, n: int, k: int,
                                                               tile: fg.GemmTile) -> None:
    """``silu_mul``: the down projection of a gated MLP's ``[M, 2K]`` gate and up halves,
    the SiLU-and-mul kernel's arithmetic done as the product loads its operand."""
    from tokenmill.kernels.triton import fused_ops

    gen = torch.Generator().manual_seed(m * n)
    gate_up = (torch.randn(m, 2 * k, generator=gen) * 3).to(HALF).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(HALF).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(HALF).to(DEVICE)
    got = fg.matmul(gate_up, w, bias, tile, silu_mul=True)
    two = fg.matmul(fused_ops.silu_and_mul(gate_up), w, bias, tile)
    if DEVICE.type == "cpu":  # the interpreter: the same arithmetic, op for op
        assert torch.equal(got, two)
    gate, up = gate_up.float().chunk(2, dim=1)
    want = F.linear((F.silu(gate).to(HALF).float() * up), w.float(), bias.float())
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2
    with pytest.raises(ValueError, match=r"a \[M, 2K\] and b \[N, K\]"):
        fg.matmul(gate_up[:, :k], w, None, tile, silu_mul=True)


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm's low-precision arithmetic: normed in fp32, rounded, scaled, rounded."""
    y = F.rms_norm(x.float(), (x.shape[1],), None, eps).to(x.dtype)
    return y * weight.to(x.dtype)


@pytest.mark.parametrize("m,n,k,tile", [
    (1, 48, 96, fg.GemmTile(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=2)),
    (5, 40, 80, fg.GemmTile(block_m=16, block_n=32, block_k=64)),  # N and K masked
    (19, 48, 64, fg.GemmTile(block_m=16, block_n=16, block_k=32, group_m=2)),  # two row tiles
])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matmul_with_the_norm_prologue_equals_norm_then_product(
        m: int, n: int, k: int, tile: fg.GemmTile, with_residual: bool) -> None:
    """``norm``: the product of ``rms_norm(a + residual) * weight``, the sum written out
    exactly as the eager add rounds it (by the first column tile's programs only, while the
    others read a and the residual), the RMS taken over all K columns though each program
    loads them a tile at a time."""
    gen = torch.Generator().manual_seed(m * n + with_residual)
    x = (torch.randn(m, k, generator=gen) * 3).to(HALF).to(DEVICE)
    residual = (torch.randn(m, k, generator=gen) * 5).to(HALF).to(DEVICE)
    norm_w = (1 + torch.randn(k, generator=gen) / 4).to(HALF).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(HALF).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(HALF).to(DEVICE)
    eps = 1e-5
    summed = torch.full_like(x, float("nan"))
    norm = (fg.NormPrologue(norm_w, eps, residual, summed) if with_residual
            else fg.NormPrologue(norm_w, eps))
    got = fg.matmul(x, w, bias, tile, norm=norm)
    s = x + residual if with_residual else x
    if with_residual:
        assert torch.equal(summed, s)
    want = F.linear(_rms_norm_reference(s, norm_w, eps).float(), w.float(), bias.float())
    assert got.dtype == HALF and got.shape == (m, n)
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2
    # Each row is normed on its own: scaling one row of the input leaves the others' outputs
    # as they were, and that row's too (the RMS divides the scale out).
    if not with_residual and m > 1:
        x2 = x.clone()
        x2[0] *= 4
        again = fg.matmul(x2, w, bias, tile, norm=norm)
        assert torch.equal(again[1:], got[1:])
        assert ((again[0].float() - got[0].float()).norm() / got[0].float().norm()) <= 1e-2


def test_the_norm_prologue_checks_its_operands() -> None:
    a = torch.zeros(2, 32, dtype=HALF, device=DEVICE)
    w = torch.zeros(16, 32, dtype=HALF, device=DEVICE)
    tile = fg.GemmTile(16, 16, 32, 1, 1, 2)
    ones = torch.ones(32, dtype=HALF, device=DEVICE)
    cases = [
        (fg.NormPrologue(ones[:16], 1e-5), r"norm's weight must be a contiguous \[32\]"),
        (fg.NormPrologue(ones, 1e-5, a.clone()), "both a residual and sum_out, or neither"),
        (fg.NormPrologue(ones, 1e-5, a[:1].clone(), a.clone()), r"residual must be \(2, 32\)"),
        (fg.NormPrologue(ones, 1e-5, a.clone(), a.float()), "sum_out must be"),
        (fg.NormPrologue(ones, 1e-5, a.clone(), a), "must not be a or the residual"),
    ]
    for norm, message in cases:
        with pytest.raises(ValueError, match=message):
            fg.matmul(a, w, None, tile, norm=norm)
    with pytest.raises(ValueError, match="not both"):
        fg.matmul(torch.zeros(2, 64, dtype=HALF, device=DEVICE), w, None, tile, silu_mul=True,
                  norm=fg.NormPrologue(ones, 1e-5))
    # A valid call after the refused ones: x = 1 everywhere normalizes to 1, times the norm's
    # weight 2, times the identity.
    x = torch.ones(2, 16, dtype=HALF, device=DEVICE)
    got = fg.matmul(x, torch.eye(16, dtype=HALF, device=DEVICE), None, fg.GemmTile(16, 16, 16),
                    norm=fg.NormPrologue(torch.full((16,), 2.0, dtype=HALF, device=DEVICE), 1e-6))
    assert torch.equal(got, torch.full_like(x, 2.0))


def test_norms_hand_their_output_to_the_tuned_projection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``RMSNorm.linear_forward``: where the projection's product has a Triton tile (patched
    in here), the norm (and the residual add) run in its kernel, with the outputs of the norm
    then the product; without one, or for an fp8 projection, the norm runs first. The
    layer's forward hooks see the call either way (the L2 prefetch hangs on them)."""
    from tokenmill.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(8)
    rms = RMSNorm(32, 1e-6).to(HALF).to(DEVICE)
    layer = Linear(32, 48, bias=False).to(HALF).to(DEVICE)
    rms.feeds(layer)  # as a DecoderLayer says it; then the model's kernels are bound
    bind_kernels(rms, kernels=TUNED)
    bind_kernels(layer, kernels=TUNED)
    with torch.no_grad():
        rms.weight.copy_(1 + torch.randn(32, generator=gen) / 4)
        layer.weight.copy_(torch.randn(48, 32, generator=gen) / 4)
    h, residual = (torch.randn(3, 32, generator=gen).to(HALF).to(DEVICE) for _ in range(2))
    hooked: list[int] = []
    layer.register_forward_hook(lambda mod, args, out: hooked.append(args[0].shape[0]))
    launches = count_matmuls(monkeypatch)
    plain = [rms.linear_forward(h, r, layer) for r in (None, residual)]
    assert launches == [] and hooked == [3, 3]
    assert torch.equal(plain[0][1], h) and torch.equal(plain[1][1], h + residual)
    tile = fg.GemmTile(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=2)
    monkeypatch.setattr(lin, "gemm_tile", lambda a, n, fp8=False, k=None: tile)
    fused = [rms.linear_forward(h, r, layer) for r in (None, residual)]
    assert launches == ["norm", "add+norm"] and hooked == [3, 3, 3, 3]
    for (want, want_sum), (got, got_sum) in zip(plain, fused, strict=True):
        assert torch.equal(got_sum, want_sum)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= 1e-2
    # A norm that quantizes for an fp8 projection keeps its own kernel (stood in for here: this
    # layer is no Fp8Linear), and the product after it has no prologue.
    rms.fp8_out = True
    monkeypatch.setattr(rms, "add_forward", lambda x, r: (torch.ones_like(x), x + r))
    rms.linear_forward(h, residual, layer)
    assert launches == ["norm", "add+norm", None]


def test_gated_mlp_computes_the_silu_in_the_down_projection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the down projection's 16-bit product has a Triton tile (a GPU's tuning; patched
    in here), GatedMLP launches no SiLU kernel: the down projection computes it, with the
    same result as SiLU then product."""
    from tokenmill.models.layers import GatedMLP

    gen = torch.Generator().manual_seed(6)
    mlp = bind_kernels(GatedMLP(32, 48, bias=False).to(HALF).to(DEVICE), kernels=TUNED)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 4)
    x = torch.randn(3, 32, generator=gen).to(HALF).to(DEVICE)
    tile = fg.GemmTile(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=2)
    prologues = count_matmuls(monkeypatch)
    unfused = mlp(x)  # no tuning: cuBLAS (F.linear) and the SiLU apart
    assert prologues == []
    monkeypatch.setattr(lin, "gemm_tile", lambda a, n, fp8=False, k=None: tile)
    fused = mlp(x)
    assert prologues == [None, "silu"]  # gate_up, then down with the SiLU
    assert ((fused.float() - unfused.float()).norm() / unfused.float().norm()).item() <= 1e-2


@pytest.mark.parametrize("arch_name,tied", [("LlamaForCausalLM", False),
                                             ("Qwen3ForCausalLM", True)])
def test_a_decode_step_through_the_tuned_matmul(monkeypatch: pytest.MonkeyPatch,
                                                arch_name: str, tied: bool) -> None:
    """A whole model's decode step with every product of up to 16 rows sent to the Triton
    matmul (a GPU's tuning; patched in here): the projections, the down projection with its
    SiLU prologue and the head give the logits of F.linear's step, to fp16's rounding. The
    prefill (more rows) is F.linear's in both."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
    from paged import PagedKVCache
    from quant_helpers import tiny_arch, tiny_model

    model = bind_kernels(tiny_model(tiny_arch(arch_name, tied=tied)).to(HALF).to(DEVICE),
                         kernels=TUNED)
    arch = model.config
    tile = fg.GemmTile(block_m=16, block_n=32, block_k=32, num_warps=2, num_stages=2)
    launches = count_matmuls(monkeypatch)

    def logits(tuned: bool) -> torch.Tensor:
        cache = PagedKVCache(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                             dtype=HALF)
        cache.kv_caches = [t.to(DEVICE) for t in cache.kv_caches]
        with monkeypatch.context() as patch:
            if tuned:
                patch.setattr(lin, "gemm_tile", lambda a, n, fp8=False, k=None:
                              tile if a.shape[0] <= 16 else None)
            out = None
            for batch in ([(0, list(range(3, 14))), (1, list(range(40, 49)))],
                          [(0, [12]), (1, [70])]):
                ids = torch.tensor([t for _, seq in batch for t in seq], device=DEVICE)
                meta, positions = cache.step([(seq_id, len(seq)) for seq_id, seq in batch])
                meta = replace(meta, slot_mapping=meta.slot_mapping.to(DEVICE),
                               query_start_loc=meta.query_start_loc.to(DEVICE),
                               seq_lens=meta.seq_lens.to(DEVICE),
                               block_tables=meta.block_tables.to(DEVICE))
                with torch.no_grad():
                    out = model.compute_logits(model(ids, positions.to(DEVICE), meta))
        assert out is not None
        return out

    want = logits(tuned=False)
    assert launches == []
    got = logits(tuned=True)
    # The decode step: per layer qkv (the input norm in it; the first layer's without a
    # residual), o, gate_up (the add and norm in it) and down (the SiLU), then the head.
    layers = arch.num_hidden_layers
    assert launches == ["norm", None, "add+norm", "silu"] + [
        "add+norm", None, "add+norm", "silu"] * (layers - 1) + [None]
    assert ((got - want).norm() / want.norm()).item() <= 1e-2


def test_scaled_mm_checks_its_operands() -> None:
    a, b, scale_a, scale_b, _ = _operands(4, 32, 64, 0)
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[N, K\]"):
        fg.scaled_mm(a, scale_a, b[:, :32], scale_b, None, OUT, fg.GemmTile())
    assert fg.scaled_mm(a[:0], scale_a[:0], b, scale_b, None, OUT, fg.GemmTile()).shape == (0, 32)


def test_rules_by_rows_and_shape() -> None:
    data = {"fp8_gemm": [
        {"max_m": 64, "n": 4096, "k": 14336, "block_m": 64, "block_n": 32},
        {"max_m": 64, "impl": "cublas"},
        {"max_m": 512, "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}],
        "gemm": [{"max_m": 1, "n": 4096, "block_m": 16, "block_n": 16, "block_k": 512}]}
    tuning = fg.parse_tuning(data, "t")
    assert tuning.tile_for(16, 4096, 14336, fp8=True) == fg.GemmTile(block_m=64, block_n=32)
    assert tuning.tile_for(16, 6144, 4096, fp8=True) is None  # cuBLAS, by the second rule
    assert tuning.tile_for(256, 6144, 4096, fp8=True) == fg.GemmTile(128, 64, 128, 8, 8, 3)
    assert tuning.tile_for(513, 6144, 4096, fp8=True) is None  # no rule: cuBLAS
    # The 16-bit list is the other one.
    assert tuning.tile_for(1, 4096, 14336) == fg.GemmTile(16, 16, 512)
    assert tuning.tile_for(2, 4096, 14336) is None
    assert tuning.tile_for(16, 4096, 14336) is None
    assert fg.GemmTuning().tile_for(1, 16, 16) is None
    # Asked again (kept per shape): the same picks, and another tuning keeps its own.
    assert tuning.tile_for(16, 4096, 14336, fp8=True) == fg.GemmTile(block_m=64, block_n=32)
    assert tuning.tile_for(1, 4096, 14336) == fg.GemmTile(16, 16, 512)
    assert fg.GemmTuning().tile_for(16, 4096, 14336, fp8=True) is None
    assert tuning == fg.parse_tuning(data, "t")  # what it has picked is not compared
    # Either list alone is a tuning.
    assert fg.parse_tuning({"gemm": data["gemm"]}, "t").fp8_rules == ()
    assert fg.parse_tuning({"fp8_gemm": data["fp8_gemm"]}, "t").rules == ()


@pytest.mark.parametrize("data,message", [
    ({}, "non-empty list 'fp8_gemm' or 'gemm'"),
    ({"fp8_gemm": [], "gemm": []}, "non-empty list 'fp8_gemm' or 'gemm'"),
    ({"fp8_gemm": [{"max_m": 0}]}, r"fp8_gemm\[0\]: max_m must be null or a positive integer"),
    ({"fp8_gemm": [{"block_m": 48}]}, r"fp8_gemm\[0\]: block_m must be a power of two"),
    ({"fp8_gemm": [{}, {"impl": "cutlass"}]}, r"fp8_gemm\[1\]: impl must be one of"),
    ({"gemm": [{"num_stages": 0}]}, r"gemm\[0\]: num_stages must be 1..8"),
    ({"gemm": {"max_m": 1}}, "gemm must be a list"),
])
def test_bad_files_name_the_entry(tmp_path: Path, data: object, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as e:
        fg.load_tuning(path)
    assert str(path) in str(e.value)


def test_the_environment_names_the_tuning_file(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"fp8_gemm": [{"max_m": 8, "block_m": 16}]}))
    fg.tuning_for_device.cache_clear()
    try:
        assert fg.tuning_for_device("Some GPU") == fg.GemmTuning()  # no file for it: cuBLAS
        fg.tuning_for_device.cache_clear()
        monkeypatch.setenv(fg.ENV_FILE, str(path))
        assert (fg.tuning_for_device("Some GPU").tile_for(8, 16, 16, fp8=True)
                == fg.GemmTile(block_m=16))
        fg.tuning_for_device.cache_clear()
        monkeypatch.setenv(fg.ENV_FILE, str(tmp_path / "missing.json"))
        with pytest.raises(ValueError, match=r"\$TOKENMILL_GEMM_TUNING=.*: no such file"):
            fg.tuning_for_device("Some GPU")
    finally:
        fg.tuning_for_device.cache_clear()


def test_fp8_linear_runs_the_tuned_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the tuning gives a tile, Fp8Linear's product is the Triton kernel's (asked with
    the activations' rows and the weight's shape), and equals the scaled product."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen)
    layer = Fp8Linear(*fp8.quantize_fp8(weight), torch.randn(48, generator=gen)).to(DEVICE)
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    asked: list[tuple[int, int, int]] = []
    tile = fg.GemmTile(block_m=16, block_n=16, block_k=32, num_warps=2, num_stages=2)

    def gemm_tile(a: torch.Tensor, n: int, fp8: bool = False) -> fg.GemmTile:
        asked.append((a.shape[0], n, a.shape[1], fp8))
        return tile

    monkeypatch.setattr(fp8, "gemm_tile", gemm_tile)
    monkeypatch.setattr(fp8, "KERNEL_DTYPE", OUT)
    got = layer(x)
    assert asked == [(5, 48, 64, True)]
    q = fp8.quantize_activation(x)
    want = ((q.values.float() @ layer.weight.float().T) * q.scale * layer.weight_scale
            + layer.bias)
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2

def test_off_cuda_the_tuning_is_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tuning(index: int) -> None:
        raise AssertionError("read a GPU's tuning for a CPU tensor")

    monkeypatch.setattr(lin, "_gemm_tuning", no_tuning)
    assert lin.gemm_tile(torch.zeros(2, 16, dtype=torch.float8_e4m3fn), 16, fp8=True) is None
    assert lin.gemm_tile(torch.zeros(2, 16, dtype=torch.bfloat16), 16) is None
    layer = Linear(16, 8)
    with torch.no_grad():  # (Linear leaves its weights uninitialized)
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(2, 16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.slow
@pytest.mark.skipif(not fp8.fp8_supported(torch.device("cpu")),
                    reason="the script's CPU run needs a CPU _scaled_mm with per-row scales "
                           "(torch 2.13 has one; a GPU image's 2.11 does not)")
def test_sweep_script_writes_a_tuning_file_the_engine_reads(tmp_path: Path) -> None:
    """benchmarks/gpu/gemm_bw.py in the interpreter (no timings there, so cuBLAS is kept
    everywhere): every tile computed and compared with cuBLAS, a rule per class and shape, the
    fp8 and 16-bit sweeps each writing their list of one file."""
    import os
    import subprocess
    import sys

    root = Path(__file__).parents[2]
    tuning = tmp_path / "t.json"
    for dtype in ("fp8", "bf16"):
        result = tmp_path / f"r-{dtype}.json"
        done = subprocess.run([sys.executable, str(root / "benchmarks/gpu/gemm_bw.py"),
                               "--dtype", dtype, "--write-tuning", str(tuning),
                               "--result-file", str(result)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(root),
                                   # the toy sizes in the interpreter, on a GPU machine too
                                   "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        rows = json.loads(result.read_text())["results"]
        assert all(t["rel_err_vs_cublas"] < 1e-3 for r in rows for t in r["triton"])
        # The 16-bit sweep times each product with the prologue the model gives it.
        assert [r["prologue"] for r in rows] == (
            [None, None] if dtype == "fp8" else [None, None, "silu", "silu", "norm", "norm"])
    loaded = fg.load_tuning(tuning)
    assert [(r.max_m, r.n, r.k, r.tile) for r in loaded.fp8_rules] == [
        (16, 48, 64, None), (None, 48, 64, None)]
    assert [(r.max_m, r.n, r.k, r.tile) for r in loaded.rules] == [
        (16, 48, 64, None), (None, 48, 64, None), (16, 48, 32, None), (None, 48, 32, None),
        (16, 40, 64, None), (None, 40, 64, None)]
