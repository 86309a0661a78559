"""Weight-only int8 / int4 linear modules against float references, both dispatch paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quant_helpers import pack_int4_by_hand

from tokenmill.quant import (
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    QuantizedEmbedding,
    kernel_choice,
    quantize_weight,
)
from tokenmill.quant.model import pin_row_kernels
from tokenmill.quant.packing import (
    INT4_BLOCK_NS,
    QUANTIZE_ROWS,
    Int4Groups,
    int4_block_n,
    int4_layout_known,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    unpack_int4_rows,
)

# (out_features, in_features): SmolLM2-135M's projections (K = 576 is no multiple of 128), a
# small square one and one whose rows end in a partial block of the int4 layout.
SHAPES = [(1536, 576), (576, 1536), (960, 576), (128, 128), (80, 64)]
ROWS = [1, 5, 40]
# Max |error| of the layer's output relative to max |reference output| (bf16 activations).
KERNEL_TOL = 2e-2
# Max relative RMS error against the float weight: half a quantization step, uniform noise.
WEIGHT_TOL = {"int8": 0.012, "int4": 0.11}


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", ROWS)
def test_matches_float_reference(method: str, shape: tuple[int, int], rows: int) -> None:
    w = _weight(*shape)
    bias = torch.randn(shape[0]) * 0.1
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    module = quantize_weight(w, bias, method, group_size=32)
    exact = F.linear(x, module.dequantize(), bias)  # what the quantized weights should give
    for dense_min_rows in (1, 10**9):  # dense bf16 path, then the int kernel
        module.dense_min_rows = dense_min_rows
        y = module(x)
        assert y.dtype == torch.float32 and y.shape == (rows, shape[0])
        assert _rel_max(y, exact) < KERNEL_TOL, dense_min_rows
    # and the quantized weights are close to the float ones
    err = (module.dequantize() - w).norm() / w.norm()
    assert err < WEIGHT_TOL[method]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_dense_and_kernel_paths_agree_and_keep_shape(method: str) -> None:
    w = _weight(192, 128, seed=3)
    module = quantize_weight(w, None, method, group_size=64)
    x = torch.randn(2, 3, 128)
    module.dense_min_rows = 1
    dense = module(x)
    module.dense_min_rows = 10**9
    kernel = module(x)
    assert dense.shape == kernel.shape == (2, 3, 192)
    assert _rel_max(dense, kernel) < KERNEL_TOL
    bf16 = module(x.bfloat16())
    assert bf16.dtype == torch.bfloat16
    assert _rel_max(bf16.float(), kernel) < 2 * KERNEL_TOL


def test_int8_quantization_is_symmetric_per_row() -> None:
    w = _weight(64, 96)
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (64,)
    deq = q.float() * scales.float().unsqueeze(1)
    assert torch.all((deq - w).abs() <= scales.float().unsqueeze(1) * 0.5 + 1e-7)
    assert torch.equal(q[3], torch.zeros(96, dtype=torch.int8))
    assert q.abs().amax(dim=1)[torch.arange(64) != 3].min() >= 126  # the range is used


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_quantization_is_asymmetric_per_group(group_size: int) -> None:
    w = _weight(48, 128) + 0.3  # off-centre, so the min matters
    w[5, :group_size] = 0.7  # a constant group: scale 0, exact
    groups = quantize_int4(w, group_size)
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15
    assert groups.scale.shape == (48, 128 // group_size)
    err = (groups.dequantize() - w).abs().view(48, -1, group_size)
    step = groups.scale.unsqueeze(-1)
    # half a step, plus the bf16 rounding of the zero point the kernel takes
    assert torch.all(err <= 0.5 * step + 2**-8 * w.abs().max())
    assert torch.allclose(groups.dequantize()[5, :group_size], torch.full((group_size,), 0.7),
                          atol=3e-3)


@pytest.mark.parametrize("n", [16, 48, 64, 80, 176, 960])
def test_int4_packed_layout_round_trips(n: int) -> None:
    assert int4_layout_known()
    q = torch.randint(0, 16, (n, 64), generator=torch.Generator().manual_seed(n),
                      dtype=torch.uint8)
    groups = Int4Groups(q, torch.ones(n, 2), torch.zeros(n, 2), 32)
    packed, scales_and_zeros = pack_int4(groups)
    assert scales_and_zeros.shape == (2, n, 2)
    assert torch.equal(unpack_int4(packed, n, 64), q)
    rows = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(unpack_int4_rows(packed, n, 64, rows), q[rows])


@pytest.mark.parametrize("block_n", INT4_BLOCK_NS)
@pytest.mark.parametrize("n", [32, 48, 64, 80, 176])
def test_unpack_reads_each_known_layout(block_n: int, n: int) -> None:
    """Both widths the CPU kernel packs with (64 with AVX-512, 32 with AVX2) read back, whatever
    this machine's CPU is."""
    q = torch.randint(0, 16, (n, 64), generator=torch.Generator().manual_seed(n),
                      dtype=torch.uint8)
    packed = pack_int4_by_hand(q, block_n)
    assert torch.equal(unpack_int4(packed, n, 64, block_n), q)
    rows = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(unpack_int4_rows(packed, n, 64, rows, block_n), q[rows])


def test_this_cpu_packs_in_a_known_width() -> None:
    q = torch.randint(0, 16, (96, 64), generator=torch.Generator().manual_seed(1),
                      dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert int4_block_n() in INT4_BLOCK_NS
    assert torch.equal(packed.view(96, 32), pack_int4_by_hand(q.to(torch.uint8), int4_block_n()))


def test_int4_packing_in_chunks_equals_packing_at_once() -> None:
    n = QUANTIZE_ROWS + 80  # several chunks, the last ending in a partial block
    q = torch.randint(0, 16, (n, 64), generator=torch.Generator().manual_seed(0),
                      dtype=torch.uint8)
    packed, _ = pack_int4(Int4Groups(q, torch.ones(n, 2), torch.zeros(n, 2), 32))
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    assert torch.equal(packed, whole)


def test_int4_from_groups_keeps_the_nibbles() -> None:
    groups = quantize_int4(_weight(96, 64), 32)
    module = Int4WeightOnlyLinear.from_groups(groups, None)
    assert torch.equal(module.nibbles(), groups.q)
    # the module's weight is the groups' up to the bf16 scale / zero it stores
    assert torch.allclose(module.dequantize(), groups.dequantize(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_lookup_and_matrix_handle(method: str) -> None:
    w = _weight(128, 64) * 20
    table = quantize_weight(w, None, method)
    embed = QuantizedEmbedding(table, torch.float32)
    ids = torch.tensor([[3, 127], [0, 64]])
    rows = embed(ids)
    assert rows.shape == (2, 2, 64) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, table.dequantize()[ids], rtol=0, atol=1e-6)
    # The tied head's product is the quantized matmul; the table offers no float weight
    assert embed.matrix is table
    h = torch.randn(4, 64)
    torch.testing.assert_close(embed.logits(h), table(h))
    assert not hasattr(embed, "weight")


def test_unsupported_shapes_and_options_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="group_size"):
        quantize_weight(_weight(64, 64), None, "int4", group_size=48)
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of group_size 64"):
        quantize_weight(_weight(64, 96), None, "int4", group_size=64)
    with pytest.raises(ValueError, match="out_features 40"):
        quantize_weight(_weight(40, 64), None, "int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_weight(_weight(64, 64), None, "int3")
    assert isinstance(quantize_weight(_weight(40, 96), None, "int8"), Int8WeightOnlyLinear)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_pinned_kernels_compute_a_row_alike_at_every_batch_size(method: str) -> None:
    # What the deterministic engine rests on: after pin_row_kernels a row's output is the same
    # bits whether it is computed alone or among 4, 5, 97 or 300 rows (the int kernels' own
    # row tiles, and sizes past the dense threshold).
    w = _weight(960, 576)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(1))
    model = torch.nn.Sequential(quantize_weight(w, None, method, group_size=32))
    pin_row_kernels(model)  # a no-op where int4 already keeps every row (int8 tile pairs)
    module = model[0]
    assert module.dense_min_rows == kernel_choice.NEVER_DENSE and module.own_min_rows == 1
    alone = torch.cat([module(x[r:r + 1]) for r in range(0, 300, 7)])
    for rows in (4, 5, 97, 300):
        picked = list(range(0, rows, 7))
        assert torch.equal(module(x[:rows])[picked], alone[:len(picked)]), rows


@pytest.mark.parametrize(("dense", "amx", "int4_rows", "int8_rows"), [
    (torch.bfloat16, True, kernel_choice.INT4_DENSE_MIN_ROWS, kernel_choice.INT8_DENSE_MIN_ROWS),
    (torch.bfloat16, False, kernel_choice.INT4_SLOW_DENSE_MIN_ROWS, kernel_choice.INT8_SLOW_DENSE_MIN_ROWS),
    (torch.float32, False, kernel_choice.INT4_SLOW_DENSE_MIN_ROWS, kernel_choice.INT8_SLOW_DENSE_MIN_ROWS),
])
def test_dense_threshold_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, dense: torch.dtype,
                                         amx: bool, int4_rows: int, int8_rows: int) -> None:
    """The int kernels keep more rows where the dense matmul is slow: fp32 (no native bf16) or
    bf16 without AMX; large weights (the head) keep their own thresholds."""
    if kernel_choice.cpu_kernels() is None:
        pytest.skip("tokenmill's C++ extension cannot be built here")
    monkeypatch.setattr(kernel_choice, "dense_dtype", lambda _device_type: dense)
    monkeypatch.setattr(kernel_choice, "cpu_has_amx", lambda: amx)
    assert kernel_choice.default_dense_min_rows("int4", 576 * 576, "cpu") == int4_rows
    assert kernel_choice.default_dense_min_rows("int8", 576 * 576, "cpu") == int8_rows
    assert (kernel_choice.default_dense_min_rows("int4", 49152 * 576, "cpu")
            == kernel_choice.INT4_LARGE_DENSE_MIN_ROWS)


def test_int4_on_int8_tile_pairs_never_goes_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where int4 layers on int8 activations run two tiles a 512-bit register, they keep every
    row count (prefill too) unless the dense matmul has AMX; int16 activations, or a weight
    the q8 tiles cannot hold, keep the slow-dense threshold."""
    ext = kernel_choice.cpu_kernels()
    if ext is None or not ext.int4_int8_tile_pairs():
        pytest.skip("no AVX512-VNNI tile-pair kernels in this build")
    monkeypatch.setattr(kernel_choice, "dense_dtype", lambda _device_type: torch.bfloat16)
    monkeypatch.setattr(kernel_choice, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(kernel_choice, "INT4_ACT_BITS", 8)
    rows = kernel_choice.default_dense_min_rows
    assert rows("int4", 576 * 576, "cpu", int8_tiles=True) == kernel_choice.NEVER_DENSE
    assert rows("int4", 576 * 576, "cpu", int8_tiles=False) == kernel_choice.INT4_SLOW_DENSE_MIN_ROWS
    assert rows("int8", 576 * 576, "cpu", int8_tiles=True) == kernel_choice.INT8_SLOW_DENSE_MIN_ROWS
    monkeypatch.setattr(kernel_choice, "INT4_ACT_BITS", 16)
    assert rows("int4", 576 * 576, "cpu", int8_tiles=True) == kernel_choice.INT4_SLOW_DENSE_MIN_ROWS
    monkeypatch.setattr(kernel_choice, "INT4_ACT_BITS", 8)
    monkeypatch.setattr(kernel_choice, "cpu_has_amx", lambda: True)
    assert rows("int4", 576 * 576, "cpu", int8_tiles=True) == kernel_choice.INT4_DENSE_MIN_ROWS
