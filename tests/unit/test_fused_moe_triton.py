"""The fused-MoE Triton kernel (tokenmill/kernels/triton/fused_moe.py) against a loop over
tokens and their experts in PyTorch, and the grouping of (token, expert) pairs it runs on.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (fp32 and fp16; the
interpreter gets bf16 wrong, so bf16 is compared on CUDA only). Shapes are small so that the
interpreter takes seconds; tests/gpu/test_fused_moe_cuda.py runs a real model's shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tokenmill.kernels.triton import fused_moe as fm  # noqa: E402
from tokenmill.kernels.triton import moe_align  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# A small tile, so that small shapes still mask rows, columns and depth and span several tiles.
SMALL = fm.MoeTile(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=2)
# Fewer programs for the interpreter at 300 tokens: one column tile, one step of depth.
WIDE = fm.MoeTile(block_m=16, block_n=32, block_k=32, group_m=4, num_warps=2, num_stages=2)


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Each token through each of its experts' gated MLPs, weighted and summed, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    x, w13, w2 = (t.double().cpu() for t in (x, w13, w2))
    for t in range(x.shape[0]):
        for weight, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist(), strict=True):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weight * (w2[e] @ (F.silu(gate) * up))
    return out


def _weights(experts: int, hidden: int, inter: int, dtype: torch.dtype,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _route(tokens: int, experts: int, k: int, gen: torch.Generator, chosen: int | None = None,
           hot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, renormalised; only the first ``chosen`` experts picked (the
    others by no token), or expert ``hot`` picked by every token."""
    logits = torch.randn(tokens, experts, generator=gen)
    if chosen is not None:
        logits[:, chosen:] = float("-inf")
    if hot is not None:
        logits[:, hot] = logits.max() + 1.0
    weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(DEVICE), ids.to(DEVICE)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = ((got.double().cpu() - want).norm() / want.norm()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k,hidden,inter,chosen,hot,tile", [
    (1, 8, 2, 48, 24, None, None, SMALL),  # decode: a token, two experts
    (37, 8, 2, 48, 24, None, None, SMALL),  # H, I not multiples of the tile
    (37, 8, 2, 32, 16, 3, None, SMALL),  # five experts no token chose
    (37, 8, 2, 32, 16, None, 5, SMALL),  # one expert every token chose
    (1, 64, 8, 32, 16, None, None, SMALL),
    (300, 64, 8, 32, 16, None, None, WIDE),
])
def test_matches_a_loop_over_tokens_and_experts(dtype: torch.dtype, tokens: int, experts: int,
                                                k: int, hidden: int, inter: int,
                                                chosen: int | None, hot: int | None,
                                                tile: fm.MoeTile) -> None:
    gen = torch.Generator().manual_seed(tokens * experts + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13, w2 = _weights(experts, hidden, inter, dtype, gen)
    weights, ids = _route(tokens, experts, k, gen, chosen, hot)
    if hot is not None:
        assert (ids == hot).any(dim=1).all()
    got = fm.fused_moe(x, w13, w2, weights, ids, tile)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    _close(got, reference_moe(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_tile_strided_rows_and_int32_ids(dtype: torch.dtype) -> None:
    """x a view with rows wider than H, int32 ids, the tile of default_tile; then the next
    call, of another shape, is answered as before."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(37, 80, generator=gen).to(DEVICE, dtype)
    x = wide[:, 8:56]
    w13, w2 = _weights(8, 48, 24, dtype, gen)
    weights, ids = _route(37, 8, 2, gen)
    _close(fm.fused_moe(x, w13, w2, weights, ids.to(torch.int32)),
           reference_moe(x, w13, w2, weights, ids), dtype)
    x = torch.randn(5, 48, generator=gen).to(DEVICE, dtype)
    weights, ids = _route(5, 8, 2, gen)
    _close(fm.fused_moe(x, w13, w2, weights, ids), reference_moe(x, w13, w2, weights, ids),
           dtype)


def test_no_tokens_gives_an_empty_output() -> None:
    gen = torch.Generator().manual_seed(0)
    w13, w2 = _weights(4, 32, 16, torch.float32, gen)
    x = torch.empty(0, 32, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    out = fm.fused_moe(x, w13, w2, torch.empty(0, 2, device=DEVICE), ids)
    assert out.shape == (0, 32)


@pytest.mark.parametrize("in_kernel", [True, False])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens,experts,k,chosen,hot", [
    (1, 64, 8, None, None), (37, 8, 2, 3, None), (37, 8, 2, None, 5), (128, 64, 8, None, None),
    (300, 64, 8, None, None)])  # 2,400 pairs: beyond the kernel's
def test_pairs_grouped_by_expert_and_padded(in_kernel: bool, block_m: int, tokens: int,
                                            experts: int, k: int, chosen: int | None,
                                            hot: int | None) -> None:
    gen = torch.Generator().manual_seed(tokens + block_m)
    _, ids = _route(tokens, experts, k, gen, chosen, hot)
    pairs = tokens * k
    if in_kernel and pairs > moe_align.KERNEL_MAX_PAIRS:
        with pytest.raises(ValueError, match="up to 1024 pairs"):
            moe_align.align_to_blocks(ids, experts, block_m, in_kernel=True)
        return
    blocks = moe_align.align_to_blocks(ids, experts, block_m, in_kernel=in_kernel)
    sorted_ids, expert_ids = blocks.sorted_ids.cpu(), blocks.expert_ids.cpu()
    total = int(blocks.total.item())
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=experts)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() == moe_align.block_capacity(pairs, experts, block_m) >= total
    assert sorted_ids.numel() % block_m == 0
    assert expert_ids.numel() == sorted_ids.numel() // block_m
    used = sorted_ids[:total]
    real = used[used < pairs]
    assert torch.equal(real.sort().values, torch.arange(pairs, dtype=torch.int32))
    assert (sorted_ids[total:] == pairs).all()
    assert (expert_ids[total // block_m:] == experts - 1).all()
    # Every block's pairs are its expert's, in token order; each chosen expert's pairs fill
    # as few blocks as they can.
    for b in range(total // block_m):
        block = used[b * block_m:(b + 1) * block_m]
        mine = block[block < pairs].long()
        assert mine.numel() > 0 and (flat[mine] == expert_ids[b]).all()
        assert torch.equal(mine, mine.sort().values)
    per_expert = torch.bincount(expert_ids[:total // block_m].long(), minlength=experts)
    assert torch.equal(per_expert, (counts + block_m - 1) // block_m)


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_the_grouping_kernel_gives_the_pytorch_ops_result(
        ids_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tensors, to the padding; and the default takes the kernel up to its limit."""
    gen = torch.Generator().manual_seed(11)
    _, ids = _route(128, 64, 8, gen)
    ids = ids.to(ids_dtype)
    got = moe_align.align_to_blocks(ids, 64, 16, in_kernel=True)
    want = moe_align.align_to_blocks(ids, 64, 16, in_kernel=False)
    for name in ("sorted_ids", "expert_ids", "total"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert moe_align.KERNEL_MAX_PAIRS == 128 * 8
    launches = []
    launch = moe_align._align_in_kernel
    monkeypatch.setattr(moe_align, "_align_in_kernel",
                        lambda *args: launches.append(1) or launch(*args))
    moe_align.align_to_blocks(ids, 64, 16)
    moe_align.align_to_blocks(torch.cat([ids, ids[:1]]), 64, 16)  # one pair over: PyTorch's
    assert launches == [1]


@pytest.mark.parametrize("change,message", [
    (dict(w13=torch.zeros(4, 30, 32)), "w13 must be"),
    (dict(w2=torch.zeros(4, 32)), "fused_moe takes"),
    (dict(ids=torch.zeros(3, 2, dtype=torch.int64)), "topk_ids"),
    (dict(ids=torch.zeros(5, 2)), "topk_ids"),
    (dict(ids=torch.zeros(5, 5, dtype=torch.int64), weights=torch.zeros(5, 5)), "top-k"),
    (dict(x=torch.zeros(5, 32, dtype=torch.float16)), "one dtype"),
    (dict(x=torch.zeros(32, 5).T), "x must be contiguous"),
])
def test_bad_arguments_are_refused(change: dict, message: str) -> None:
    args = dict(x=torch.zeros(5, 32), w13=torch.zeros(4, 32, 32), w2=torch.zeros(4, 32, 16),
                weights=torch.zeros(5, 2), ids=torch.zeros(5, 2, dtype=torch.int64))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        fm.fused_moe(args["x"], args["w13"], args["w2"], args["weights"], args["ids"])


@pytest.mark.parametrize("field,value", [("block_m", 8), ("block_n", 48), ("group_m", 0),
                                         ("num_warps", 3), ("num_stages", 9)])
def test_bad_tiles_are_refused(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        fm.MoeTile(**{field: value})


def test_default_tile_pads_decode_least() -> None:
    assert fm.default_tile(8, 128).block_m == 16  # batch-1 decode, k = 8
    assert fm.default_tile(32 * 8, 128).block_m == 16
    assert fm.default_tile(512 * 8, 128).block_m == 64
    assert fm.default_tile(8192 * 8, 128).block_m == 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_cuda_kernel_set_binds_it_to_stacked_experts(dtype: torch.dtype,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts of a model built for CUDA multiply with the fused kernel (here in the
    interpreter: two launches), as the grouped PyTorch path does; a call the kernel does not
    take (x with strided columns) goes to that path."""
    from tokenmill.models.kernel_binding import TORCH_KERNELS, bind_kernels, triton_kernels
    from tokenmill.models.moe import StackedExperts

    launches = []
    launch = fm._launch
    monkeypatch.setattr(fm, "_launch",
                        lambda *args, **kw: launches.append(1) or launch(*args, **kw))
    gen = torch.Generator().manual_seed(3)
    experts = StackedExperts(8, 48, 24)
    experts.w13.data, experts.w2.data = _weights(8, 48, 24, dtype, gen)
    x = torch.randn(37, 48, generator=gen).to(DEVICE, dtype)
    weights, ids = _route(37, 8, 2, gen)
    want = reference_moe(x, experts.w13, experts.w2, weights, ids)
    _close(bind_kernels(experts, kernels=TORCH_KERNELS)(x, weights, ids), want, dtype)
    assert not launches
    _close(bind_kernels(experts, kernels=triton_kernels())(x, weights, ids), want, dtype)
    assert len(launches) == 2
    strided = torch.randn(48, 37, generator=gen).to(DEVICE, dtype).T
    _close(experts(strided, weights, ids),
           reference_moe(strided, experts.w13, experts.w2, weights, ids), dtype)
    assert len(launches) == 2


QUANTIZED = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", QUANTIZED)
@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (37, 8, 2)])
def test_quantized_experts_match_their_dequantized_weights(dtype: torch.dtype,
                                                           wdtype: torch.dtype, tokens: int,
                                                           experts: int, k: int) -> None:
    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, 48, generator=gen).to(DEVICE, dtype)
    w13, w2 = _weights(experts, 48, 24, torch.float32, gen)
    (q13, s13), (q2, s2) = fm.quantize_experts(w13, wdtype), fm.quantize_experts(w2, wdtype)
    weights, ids = _route(tokens, experts, k, gen)
    got = fm.fused_moe(x, q13, q2, weights, ids, SMALL, w13_scale=s13, w2_scale=s2)
    assert got.dtype == dtype
    want = reference_moe(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights,
                         ids)
    _close(got, want, dtype)
    # The next call, of 16-bit experts, as before.
    _close(fm.fused_moe(x, w13.to(dtype), w2.to(dtype), weights, ids, SMALL),
           reference_moe(x, w13.to(dtype), w2.to(dtype), weights, ids), dtype)


@pytest.mark.parametrize("wdtype,tol", [(torch.int8, 1e-2), (torch.float8_e4m3fn, 4e-2)])
def test_quantize_experts_scales_each_row(wdtype: torch.dtype, tol: float) -> None:
    """A row's peak maps onto the dtype's largest value; int8 rounds each weight to within
    half its row's step."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 20, 40, generator=gen)
    w[1, 4] = 0.0
    q, scale = fm.quantize_experts(w, wdtype)
    assert q.dtype == wdtype and q.shape == w.shape and scale.shape == (3, 20)
    assert scale[1, 4] == 1.0 and (q[1, 4].float() == 0).all()
    back = q.float() * scale[..., None]
    assert ((back - w).norm() / w.norm()).item() < tol
    assert torch.allclose(back.abs().amax(dim=-1), w.abs().amax(dim=-1), rtol=1e-6)
    if wdtype == torch.int8:
        assert ((back - w).abs() <= scale[..., None] * 0.5001).all()
    with pytest.raises(ValueError, match="dtype must be one of"):
        fm.quantize_experts(w, torch.float16)


@pytest.mark.parametrize("change,message", [
    (dict(w2_scale=None), "both w13_scale and w2_scale"),
    (dict(w13_scale=torch.ones(4, 16)), "w13_scale must be float32 \\[4, 32\\]"),
    (dict(w2_scale=torch.ones(4, 32, dtype=torch.float16)), "w2_scale must be float32"),
    (dict(w13=torch.zeros(4, 32, 32)), "both be int8 or float8_e4m3fn"),
])
def test_bad_quantized_arguments_are_refused(change: dict, message: str) -> None:
    args = dict(w13=torch.zeros(4, 32, 32, dtype=torch.int8),
                w2=torch.zeros(4, 32, 16, dtype=torch.int8), w13_scale=torch.ones(4, 32),
                w2_scale=torch.ones(4, 32))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        fm.fused_moe(torch.zeros(5, 32), args["w13"], args["w2"], torch.zeros(5, 2),
                     torch.zeros(5, 2, dtype=torch.int64), w13_scale=args["w13_scale"],
                     w2_scale=args["w2_scale"])
