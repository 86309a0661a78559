"""tokenmill's integer-activation CPU kernels (tokenmill/kernels/cpu/int_dot.h): int4 weights in q8
tiles times int8 or int16 activations, int8 weights times int16 activations. Each is checked against a
reference written here from the definition (the same activation quantization, exact integer
dots in float64), against the fp32 product within the quantization's error, and against itself
at other row counts (a row's bits must not depend on the rest of the batch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from quant_helpers import gen, int4_case

from tokenmill.kernels.cpu import load_extension
from tokenmill.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear, kernel_choice
from tokenmill.quant.kernel_choice import cpu_kernels
from tokenmill.quant.packing import pack_int4_q8, pack_int8_q16_tiles, q8_layout_fits

ROWS = [1, 2, 3, 4, 5, 9, 40]


@pytest.fixture(scope="module")
def ext():
    return load_extension()


def _quantize_blocks(x: torch.Tensor, block: int, levels: int):
    """x [M, K] as integers in [-levels, levels] per block of ``block`` inputs, and the scales
    [M, K / block]: round-half-even of x * levels / absmax, scale absmax / levels."""
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    amax = xb.abs().amax(dim=-1)
    # levels / amax rounded once to fp32, as the kernel divides (torch's own fp32 division of
    # a scalar by a tensor can be off by an ulp, enough to move a tie)
    inv = torch.where(amax > 0, (levels / amax.double()).float(), torch.zeros_like(amax))
    q = torch.round(xb * inv.unsqueeze(-1))
    return q.view(m, k), amax / levels


def _int4_q8_reference(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, group: int,
                       bits: int):
    """y [M, N] in float64 from the definition in int_dot.h."""
    xq, d = _quantize_blocks(x, 32, 127 if bits == 8 else 32767)
    m, k = x.shape
    n = q.shape[0]
    blocks = k // 32
    # integer dot per (row, output, block)
    idot = torch.einsum("mbi,nbi->mnb", xq.double().view(m, blocks, 32),
                        q.double().view(n, blocks, 32))
    per_group = group // 32
    dot = (idot * d.double().unsqueeze(1)).view(m, n, k // group, per_group).sum(-1)
    xsum = (xq.double().view(m, blocks, 32).sum(-1) * d.double()).view(
        m, k // group, per_group).sum(-1)
    scale = sz[..., 0].double().t()  # [N, G]
    z8 = sz[..., 1].double().t() - 8 * scale
    return (dot * scale.unsqueeze(0)).sum(-1) + (xsum.unsqueeze(1) * z8.unsqueeze(0)).sum(-1)


def test_q8_packing_layout() -> None:
    """Byte 4 j + i of tile t, step s: input 4 s + i of output 16 t + j (low nibble) and of
    output 16 t + 8 + j (high nibble); scales [tiles, groups, 2, 16]."""
    n, k, group = 48, 64, 32
    q, sz, _ = int4_case(n, k, group)
    packed, scales = pack_int4_q8(q, sz)
    assert packed.shape == (n // 16, k // 4, 32) and packed.dtype == torch.uint8
    assert scales.shape == (n // 16, k // group, 2, 16) and scales.dtype == torch.bfloat16
    for t, s, j, i in [(0, 0, 0, 0), (1, 3, 7, 2), (2, 15, 5, 3), (2, 7, 0, 1)]:
        byte = int(packed[t, s, 4 * j + i])
        assert byte & 15 == int(q[16 * t + j, 4 * s + i])
        assert byte >> 4 == int(q[16 * t + 8 + j, 4 * s + i])
    for t, g, j in [(0, 0, 0), (1, 1, 9), (2, 0, 15)]:
        assert scales[t, g, 0, j] == sz[g, 16 * t + j, 0]
        assert scales[t, g, 1, j] == sz[g, 16 * t + j, 1]


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n", [64, 80])  # an even and an odd number of tiles of 16
def test_int4_q8_matches_its_definition(ext, group: int, bits: int, n: int) -> None:
    k = 256
    q, sz, w = int4_case(n, k, group)
    packed, scales = pack_int4_q8(q, sz)
    x = torch.randn(40, k, generator=gen(7))
    x[3, :32] = 0.0  # an all-zero block: scale 0, no division by zero
    ref = _int4_q8_reference(x, q, sz, group, bits)
    exact = x.double() @ w.double().t()
    full = ext.int4_q8_linear(x, packed, scales, group, bits)
    assert full.dtype == torch.float32 and full.shape == (40, n)
    for rows in ROWS:
        y = ext.int4_q8_linear(x[:rows], packed, scales, group, bits)
        # the same bits for a row whatever the row count
        assert torch.equal(y, full[:rows]), rows
    err = ((full.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err
    # steps of 1/127 (int8) or 1/32767 (int16) of each block's largest value
    rel = ((full.double() - exact).norm() / exact.norm()).item()
    assert rel < (0.02 if bits == 8 else 1e-4), rel
    # Tile by tile (AVX-512 builds compute two tiles at once where they can): the same bits.
    for t in range(n // 16):
        alone = ext.int4_q8_linear(x, packed[t:t + 1].contiguous(),
                                   scales[t:t + 1].contiguous(), group, bits)
        assert torch.equal(alone, full[:, 16 * t:16 * t + 16]), t
    xb = x.to(torch.bfloat16)
    yb = ext.int4_q8_linear(xb, packed, scales, group, bits)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, ext.int4_q8_linear(xb.float(), packed, scales, group, bits).bfloat16())


def test_int4_q8_rejects_bad_shapes(ext) -> None:
    q, sz, _ = int4_case(32, 64, 32)
    packed, scales = pack_int4_q8(q, sz)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.int4_q8_linear(torch.randn(1, 64), packed, scales, 16)
    with pytest.raises(RuntimeError, match=r"\[N / 16, K / 4, 32\]"):
        ext.int4_q8_linear(torch.randn(1, 128), packed, scales, 32)
    with pytest.raises(RuntimeError, match="scales"):
        ext.int4_q8_linear(torch.randn(1, 64), packed, scales[:1], 32)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ext.int4_q8_linear(torch.randn(1, 64).double(), packed, scales, 32)
    with pytest.raises(RuntimeError, match="8 or 16 bits"):
        ext.int4_q8_linear(torch.randn(1, 64), packed, scales, 32, 4)
    assert not q8_layout_fits(40, 64, 32) and not q8_layout_fits(32, 64, 16)
    assert q8_layout_fits(32, 64, 32)


def _int8_case(n: int, k: int, seed: int = 0):
    w = torch.randint(-127, 128, (n, k), generator=gen(seed), dtype=torch.int8)
    scales = (torch.rand(n, generator=gen(seed + 1)) * 0.01 + 0.001).to(torch.bfloat16)
    return w, scales


@pytest.mark.parametrize("k", [16, 77, 576, 4100])  # a tail past 16s; past the int32 flush
def test_int8_q16_matches_its_definition(ext, k: int) -> None:
    n = 37  # not a multiple of the 4 weight rows per pass
    w, scales = _int8_case(n, k)
    x = torch.randn(9, k, generator=gen(3)) * 4
    xq, d = _quantize_blocks(x, k, 32767)
    ref = (xq.double() @ w.double().t()) * d.double() * scales.double()
    exact = (x.double() @ w.double().t()) * scales.double()
    full = ext.int8_q16_linear(x, w, scales)
    assert full.dtype == torch.float32 and full.shape == (9, n)
    for rows in [1, 2, 3, 9]:
        assert torch.equal(ext.int8_q16_linear(x[:rows], w, scales), full[:rows]), rows
    assert ((full.double() - ref).abs() <= ref.abs() * 1e-6 + 1e-9).all()
    err = ((full.double() - exact).abs().max() / exact.abs().max()).item()
    assert err < 1e-4, err  # int16 activations: far finer than bf16's 2^-8


def test_int8_q16_extreme_weights_do_not_overflow(ext) -> None:
    """Every weight -128 and every activation at the int16 limit, over 8,192 inputs."""
    k = 8192
    w = torch.full((4, k), -128, dtype=torch.int8)
    x = torch.full((1, k), 3.0)
    y = ext.int8_q16_linear(x, w, torch.ones(4))
    assert torch.allclose(y.double(), torch.full((1, 4), -128.0 * 3.0 * k, dtype=torch.float64),
                          rtol=1e-6)


def test_int8_q16_rejects_bad_input(ext) -> None:
    w, scales = _int8_case(8, 32)
    with pytest.raises(RuntimeError, match="inputs"):
        ext.int8_q16_linear(torch.randn(1, 16), w, scales)
    with pytest.raises(RuntimeError, match="scales for"):
        ext.int8_q16_linear(torch.randn(1, 32), w, scales[:3])
    with pytest.raises(RuntimeError, match="int8"):
        ext.int8_q16_linear(torch.randn(1, 32), w.float(), scales)


def test_int8_q16_tiles_packing_layout() -> None:
    """Unit u, pair p, byte 32 t + 2 j + i: input 2 p + i of output 32 u + 16 t + j; outputs
    padded to whole units and inputs to whole pairs with zeros."""
    n, k = 37, 9
    w = torch.randint(-128, 128, (n, k), generator=gen(5), dtype=torch.int8)
    tiles = pack_int8_q16_tiles(w)
    assert tiles.shape == (2, 5, 64) and tiles.dtype == torch.int8
    for u in range(2):
        for p in range(5):
            for t in range(2):
                for j in range(16):
                    for i in range(2):
                        row, col = 32 * u + 16 * t + j, 2 * p + i
                        want = int(w[row, col]) if row < n and col < k else 0
                        assert int(tiles[u, p, 32 * t + 2 * j + i]) == want


@pytest.mark.parametrize("n,k", [(37, 77), (64, 576), (100, 4100), (5, 2)])
def test_int8_q16_tiles_same_bits_as_rows(ext, n: int, k: int) -> None:
    """The output-tiled kernel gives int8_q16_linear's bits at every row count (one pass, several
    passes of 8 rows, a block of 32 rows and past it), for fp32 and bf16 activations and
    scales; k = 4100 crosses the int32 flush (512 inputs) and the L1 slabs (256)."""
    w, scales = _int8_case(n, k, seed=7)
    tiles = pack_int8_q16_tiles(w)
    x = torch.randn(41, k, generator=gen(8)) * 3
    for xs, ss in [(x, scales), (x.bfloat16(), scales), (x, scales.float())]:
        for rows in [1, 3, 4, 8, 13, 32, 41]:
            want = ext.int8_q16_linear(xs[:rows], w, ss)
            got = ext.int8_q16_tiles_linear(xs[:rows], tiles, ss, n)
            assert got.dtype == xs.dtype and torch.equal(got, want), (rows, xs.dtype, ss.dtype)


@pytest.mark.parametrize("n,k", [(37, 77), (64, 576), (100, 4100), (37, 66000)])
def test_int8_q16_tiles_amx_same_bits_as_the_vector_path(ext, n: int, k: int) -> None:
    """On a CPU with AMX-INT8, calls of 12+ rows run on the tile unit (activations split into
    high and low bytes): the same bits as the vector path for fp32 and bf16 activations and
    scales, one tile of rows and more, inputs past the int32 sums' bound (65,536) on the
    vector path. Skips where the extension has no AMX path (no AMX, or not granted)."""
    if not ext.amx_in_use():
        pytest.skip("no AMX on this CPU (or the kernel refused the tile state)")
    w, scales = _int8_case(n, k, seed=11)
    tiles = pack_int8_q16_tiles(w)
    x = torch.randn(41, k, generator=gen(12)) * 3
    x[5] = 0.0  # an all-zero row: scale 0
    try:
        for xs, ss in [(x, scales), (x.bfloat16(), scales), (x, scales.float())]:
            for rows in [12, 16, 17, 33, 41]:
                ext.set_amx(True)
                amx = ext.int8_q16_tiles_linear(xs[:rows], tiles, ss, n)
                ext.set_amx(False)
                vector = ext.int8_q16_tiles_linear(xs[:rows], tiles, ss, n)
                assert torch.equal(amx, vector), (rows, xs.dtype, ss.dtype)
    finally:
        ext.set_amx(True)
    assert ext.amx_in_use()


def test_tokenmill_amx_0_turns_the_amx_path_off(ext) -> None:
    """TOKENMILL_AMX=0 in the environment: the extension loads with the AMX path off."""
    code = "from tokenmill.kernels.cpu import load_extension; print(load_extension().amx_in_use())"
    env = dict(os.environ, TOKENMILL_AMX="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_int8_q16_tiles_extreme_weights_do_not_overflow(ext) -> None:
    """Every weight -128 and every activation at the int16 limit, over 8,192 inputs (16
    flushes of the int32 lanes)."""
    k = 8192
    w = torch.full((4, k), -128, dtype=torch.int8)
    x = torch.full((5, k), 3.0)
    y = ext.int8_q16_tiles_linear(x, pack_int8_q16_tiles(w), torch.ones(4), 4)
    assert torch.allclose(y.double(), torch.full((5, 4), -128.0 * 3.0 * k, dtype=torch.float64),
                          rtol=1e-6)


def test_int8_q16_tiles_rejects_bad_input(ext) -> None:
    w, scales = _int8_case(8, 32)
    tiles = pack_int8_q16_tiles(w)
    with pytest.raises(RuntimeError, match="tiles must be"):
        ext.int8_q16_tiles_linear(torch.randn(1, 34), tiles, scales, 8)  # 17 pairs, not 16
    with pytest.raises(RuntimeError, match="tiles must be"):
        ext.int8_q16_tiles_linear(torch.randn(1, 32), tiles, scales, 40)  # two units' outputs
    with pytest.raises(RuntimeError, match="scales for"):
        ext.int8_q16_tiles_linear(torch.randn(1, 32), tiles, scales[:3], 8)
    with pytest.raises(RuntimeError, match="out_features"):
        ext.int8_q16_tiles_linear(torch.randn(1, 32), tiles, scales, 0)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ext.int8_q16_tiles_linear(torch.randn(1, 32).double(), tiles, scales, 8)
    x = torch.randn(5, 32, generator=gen(4))  # and the next good call computes as before
    assert torch.equal(ext.int8_q16_tiles_linear(x, tiles, scales, 8),
                       ext.int8_q16_linear(x, w, scales))


def test_int8_head_takes_the_tiles_from_a_few_rows(monkeypatch) -> None:
    """An int8 head (row_tiles) packs its tiles on the first call of INT8_TILES_MIN_ROWS rows
    and gives the bits of the row kernel; other int8 layers never pack them."""
    if cpu_kernels() is None:
        pytest.skip("tokenmill's C++ extension cannot be built here")
    monkeypatch.setattr(kernel_choice, "USE_INT_ACTIVATIONS", True)
    w = torch.randn(96, 128, generator=gen(11)) * 0.05
    head = Int8WeightOnlyLinear.from_weight(w, None)
    layer = Int8WeightOnlyLinear.from_weight(w, None)
    head.row_tiles = head.fp32_io = layer.fp32_io = True
    x = torch.randn(9, 128, generator=gen(12))
    few = kernel_choice.INT8_TILES_MIN_ROWS - 1
    assert torch.equal(head(x[:few]), layer(x[:few])) and head._tiles is None
    assert torch.equal(head(x), layer(x))
    assert head._tiles is not None and layer._tiles is None


@pytest.fixture
def int_activations(monkeypatch):
    if cpu_kernels() is None:
        pytest.skip("tokenmill's C++ extension cannot be built here")

    def set_flag(on: bool) -> None:
        monkeypatch.setattr(kernel_choice, "USE_INT_ACTIVATIONS", on)
    return set_flag


def test_modules_take_the_integer_kernels(int_activations) -> None:
    """Layers compute on integer activations at every row count below the dense path (one row
    included), and on the fp32 kernels with the switch off; both near the float product."""
    w = torch.randn(96, 128, generator=gen(1)) * 0.05
    x = torch.randn(5, 128, generator=gen(2))
    int4 = Int4WeightOnlyLinear.from_weight(w, None, 32)
    int8 = Int8WeightOnlyLinear.from_weight(w, None)
    for module in (int4, int8):
        ref = x @ module.dequantize().t()
        int_activations(True)
        assert module.int_activations() and module.own_min_rows == 1
        on = module(x)
        int_activations(False)
        assert not module.int_activations()
        off = module(x)
        assert not torch.equal(on, off)  # two different kernels ran
        for y in (on, off):
            assert ((y - ref).norm() / ref.norm()).item() < 0.02
        int_activations(True)
        assert torch.equal(module(x[:1]), on[:1])  # one row takes the same kernel
    tiles = int4.q8_tiles()
    assert tiles is not None and int4.q8_tiles() is tiles  # packed once


def test_int4_decode_steps_take_their_own_activation_bits(int_activations) -> None:
    """int4 layers compute on INT4_ACT_BITS activations in prompt steps and on
    decode_act_bits (int8 by default) in steps the step backend marks decode-only
    (StepKindMarks); pin_row_kernels (the deterministic engine) makes both the prompt's."""
    from tokenmill.quant.linear import StepKindMarks
    from tokenmill.quant.model import pin_row_kernels

    int_activations(True)
    ext = cpu_kernels()
    w = torch.randn(96, 128, generator=gen(21)) * 0.05
    layer = Int4WeightOnlyLinear.from_weight(w, None, 32)
    assert layer.decode_act_bits == kernel_choice.INT4_DECODE_ACT_BITS
    x = torch.randn(3, 128, generator=gen(22))
    packed, scales = layer.q8_tiles()
    xb = x.to(torch.bfloat16)

    def kernel(bits: int) -> torch.Tensor:
        return ext.int4_q8_linear(xb, packed, scales, 32, bits).to(x.dtype)

    layer.decode_act_bits = 8
    marks = StepKindMarks(torch.nn.Sequential(layer))
    assert marks.layers == [layer]
    assert torch.equal(layer(x), kernel(kernel_choice.INT4_ACT_BITS))
    marks.mark(True)
    assert torch.equal(layer(x), kernel(8))
    marks.mark(False)  # a prompt step after it takes the prompt's again
    assert torch.equal(layer(x), kernel(kernel_choice.INT4_ACT_BITS))
    assert layer.activation_bits() == kernel_choice.INT4_ACT_BITS
    assert layer.activation_bits(decode_only=True) == 8
    pin_row_kernels(torch.nn.Sequential(layer))
    assert layer.activation_bits(decode_only=True) == kernel_choice.INT4_ACT_BITS
    marks.mark(True)
    assert torch.equal(layer(x), kernel(kernel_choice.INT4_ACT_BITS))


@pytest.mark.parametrize("bits", [8, 16])
def test_streamed_weight_fetch_computes_the_same_bits(ext, bits: int) -> None:
    """Non-temporal weight fetches (models larger than the last-level cache) change where the
    weights are cached, never what is computed: the int4 kernel (one tile, tile pairs) and the
    int8 head (row kernel and output tiles) give the same bits with streaming on and off."""
    n, k = 48, 576
    q, sz, _ = int4_case(n, k, 64)
    packed, scales = pack_int4_q8(q, sz)
    w8, s8 = _int8_case(n, k, seed=3)
    tiles = pack_int8_q16_tiles(w8)
    was = ext.stream_weights()
    try:
        for rows in (1, 5):
            x = torch.randn(rows, k, generator=gen(rows)).to(torch.bfloat16)
            out = {}
            for on in (False, True):
                ext.set_stream_weights(on)
                assert ext.stream_weights() is on
                out[on] = [ext.int4_q8_linear(x, packed, scales, 64, bits),
                           ext.int8_q16_linear(x, w8, s8),
                           ext.int8_q16_tiles_linear(x, tiles, s8, n)]
            for off, streamed in zip(out[False], out[True], strict=True):
                assert torch.equal(off, streamed), rows
    finally:
        ext.set_stream_weights(was)
