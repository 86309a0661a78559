"""tokenmill's own CPU int4 / int8 matmuls (tokenmill/kernels/cpu/quant_gemm.h) against fp32
references computed from the same quantized values, PyTorch's kernels, and themselves at other
row counts (a row's bits must not depend on how many rows share the call)."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import gen, int4_case, pack_int4_by_hand

from tokenmill.kernels.cpu import load_extension
from tokenmill.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from tokenmill.quant.kernel_choice import cpu_kernels
from tokenmill.quant.packing import INT4_BLOCK_NS, int4_block_n

# Row counts that reach every path: the 1- and 2-row register kernels, the 6-row tile kernel
# and its remainders.
ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 40]


@pytest.fixture(scope="module")
def ext():
    return load_extension()


@pytest.mark.parametrize("block_n", INT4_BLOCK_NS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_matches_fp32_reference_in_each_layout(ext, block_n: int, group: int) -> None:
    n, k = 2 * block_n, 256
    q, sz, w = int4_case(n, k, group)
    packed = pack_int4_by_hand(q, block_n)
    x = torch.randn(40, k, generator=gen(7))
    ref = x.double() @ w.double().t()
    for rows in ROWS:
        y = ext.int4_linear(x[:rows], packed, sz, group, block_n)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        err = ((y.double() - ref[:rows]).abs().max() / ref[:rows].abs().max()).item()
        assert err < 1e-5, (rows, err)
    # bf16 activations: widened exactly, the output rounded once.
    xb = x.to(torch.bfloat16)
    y = ext.int4_linear(xb, packed, sz, group, block_n)
    assert y.dtype == torch.bfloat16
    exact = xb.double() @ w.double().t()
    assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("block_n", INT4_BLOCK_NS)
def test_int4_rows_keep_their_bits_at_every_row_count(ext, block_n: int) -> None:
    q, sz, _ = int4_case(3 * block_n, 192, 32, seed=3)
    packed = pack_int4_by_hand(q, block_n)
    x = torch.randn(64, 192, generator=gen(11))
    full = ext.int4_linear(x, packed, sz, 32, block_n)
    for rows in [*ROWS, 63]:
        assert torch.equal(ext.int4_linear(x[:rows], packed, sz, 32, block_n), full[:rows])
        assert torch.equal(ext.int4_linear(x[rows - 1:rows], packed, sz, 32, block_n),
                           full[rows - 1:rows])


def test_int4_agrees_with_pytorchs_kernel_on_its_own_packing(ext) -> None:
    w = torch.randn(960, 576, generator=gen(5)) * 0.05
    module = Int4WeightOnlyLinear.from_weight(w, None, 32)
    x = torch.randn(33, 576, generator=gen(6)).to(torch.bfloat16)
    ours = ext.int4_linear(x, module.weight, module.scales_and_zeros, 32, int4_block_n())
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, module.weight, 32,
                                                        module.scales_and_zeros)
    err = ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()
    assert err < 1e-2


@pytest.mark.parametrize(("n", "k"), [(48, 64), (50, 77), (16, 8), (1, 3), (200, 1536)])
def test_int8_matches_fp32_reference(ext, n: int, k: int) -> None:
    # Output counts that end in a partial tile of 16 and of 4, inputs past a multiple of 8.
    w = torch.randint(-127, 128, (n, k), generator=gen(n), dtype=torch.int8)
    scales = (torch.rand(n, generator=gen(k)) * 0.01 + 1e-4).to(torch.bfloat16)
    x = torch.randn(40, k, generator=gen(3))
    ref = x.double() @ (w.double() * scales.double()[:, None]).t()
    full = ext.int8_linear(x, w, scales)
    for rows in ROWS:
        y = ext.int8_linear(x[:rows], w, scales)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        err = ((y.double() - ref[:rows]).abs().max() / ref[:rows].abs().max()).item()
        assert err < 1e-5, (rows, err)
        assert torch.equal(y, full[:rows]), rows
        assert torch.equal(ext.int8_linear(x[rows - 1:rows], w, scales), full[rows - 1:rows])
    yb = ext.int8_linear(x.to(torch.bfloat16), w, scales)
    assert yb.dtype == torch.bfloat16


def test_no_rows_and_bad_arguments(ext) -> None:
    q, sz, _ = int4_case(32, 64, 32)
    packed = pack_int4_by_hand(q, 32)
    assert ext.int4_linear(torch.empty(0, 64), packed, sz, 32, 32).shape == (0, 32)
    w8 = torch.zeros(16, 64, dtype=torch.int8)
    assert ext.int8_linear(torch.empty(0, 64), w8, torch.ones(16)).shape == (0, 16)
    with pytest.raises(RuntimeError, match="groups of"):
        ext.int4_linear(torch.randn(2, 96), packed, sz, 32, 32)
    with pytest.raises(RuntimeError, match="block width"):
        ext.int4_linear(torch.randn(2, 64), packed, sz, 32, 48)
    with pytest.raises(RuntimeError, match="int8"):
        ext.int8_linear(torch.randn(2, 64), w8.float(), torch.ones(16))
    with pytest.raises(RuntimeError, match="inputs"):
        ext.int8_linear(torch.randn(2, 63), w8, torch.ones(16))
    with pytest.raises(RuntimeError, match="scales"):
        ext.int8_linear(torch.randn(2, 64), w8, torch.ones(15))


def test_modules_compute_with_them_and_fall_back_without(monkeypatch) -> None:
    """The int modules' CPU path is these kernels; with them off, PyTorch's, within bf16."""
    assert cpu_kernels() is not None
    w = torch.randn(96, 64, generator=gen(2)) * 0.05
    x = torch.randn(9, 64, generator=gen(4))
    for module in (Int4WeightOnlyLinear.from_weight(w, None, 32),
                   Int8WeightOnlyLinear.from_weight(w, None)):
        module.dense_min_rows = 10**9
        ours = module(x)
        monkeypatch.setattr("tokenmill.quant.kernel_choice.USE_CPU_KERNELS", False)
        theirs = module(x)
        monkeypatch.setattr("tokenmill.quant.kernel_choice.USE_CPU_KERNELS", True)
        assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3])
def test_heads_compute_fp32_logits(ext, method: str, rows: int) -> None:
    """An fp32 model's quantized head takes fp32 hidden states and returns fp32 logits, as
    exact as the weights allow: bf16 logits are 0.125 apart around 20 and tie greedy choices."""
    from tokenmill.quant.model import wrap_head

    w = torch.randn(512, 128, generator=gen(7)) * 0.5
    linear = (Int8WeightOnlyLinear.from_weight(w, None) if method == "int8"
              else Int4WeightOnlyLinear.from_weight(w, None, group_size=32))
    head = wrap_head(linear, tied=False, dtype=torch.float32)
    x = torch.randn(rows, 128, generator=gen(8)) * 4
    y = head(x)
    ref = x.double() @ linear.dequantize().double().T
    assert y.dtype == torch.float32
    # int8 heads take int16 activations (int_dot.h): steps of 3e-5 of the largest, 250x finer
    # than bf16's; int4 heads widen fp32 activations exactly.
    tol = 1e-4 if linear.int_activations() else 1e-5
    assert (y.double() - ref).abs().max() < tol * ref.abs().max()
    # The same module as a body layer (no fp32_io) rounds to bf16: far coarser.
    linear.fp32_io = False
    assert (linear(x).double() - ref).abs().max() > 1e-4 * ref.abs().max()


@pytest.mark.parametrize("block_n", INT4_BLOCK_NS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_dequantize_matches_pytorch_bit_for_bit(ext, block_n: int, group: int) -> None:
    """The dense path's C++ decoding gives the bf16 weight of PyTorch's ops (packing.py's
    dequantize_int4_t: one rounding of (q - 8) * scale + zero), transposed."""
    from tokenmill.quant.packing import dequantize_int4_t

    n, k = 3 * block_n, 256
    q, sz, w = int4_case(n, k, group, seed=3)
    packed = pack_int4_by_hand(q, block_n)
    w_t = ext.dequantize_int4_t(packed, sz, group, n, k, block_n)
    assert w_t.dtype == torch.bfloat16 and w_t.shape == (k, n)
    # One rounding to bf16 of the fp32 weight: within half a bf16 step of it, everywhere.
    assert bool(((w_t.float() - w.t()).abs() <= w.t().abs() * 2 ** -8 + 1e-30).all())
    if block_n == int4_block_n():  # PyTorch's ops read this build's layout only
        ref = dequantize_int4_t(packed, sz, group, n, k)
        assert torch.equal(w_t.view(torch.int16), ref.view(torch.int16))


def test_int4_dequantize_rejects_bad_shapes(ext) -> None:
    q, sz, _ = int4_case(64, 128, 32)
    packed = pack_int4_by_hand(q, 64)
    with pytest.raises(RuntimeError, match="whole blocks of block_n"):
        ext.dequantize_int4_t(packed, sz, 32, 64, 128, 48)
    with pytest.raises(RuntimeError, match="N \\* K / 2 bytes"):
        ext.dequantize_int4_t(packed[:-1], sz, 32, 64, 128, 64)
    with pytest.raises(RuntimeError, match="scales_and_zeros must be"):
        ext.dequantize_int4_t(packed, sz.float(), 32, 64, 128, 64)
