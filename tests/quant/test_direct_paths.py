"""The fused decoder's shortcuts to the C++ kernels for the token embedding and the output head
(``QuantizedEmbedding.direct_lookup``, ``Int8WeightOnlyLinear.direct_rows_kernel``): the same
bits as the modules' own forward, taken only where forward would take that kernel."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import gen

from tokenmill.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear, QuantizedEmbedding
from tokenmill.quant.kernel_choice import INT8_TILES_MIN_ROWS, cpu_kernels
from tokenmill.quant.model import wrap_head


@pytest.fixture(scope="module")
def ext():  # noqa: ANN201
    ext = cpu_kernels()
    if ext is None:
        pytest.skip("tokenmill's C++ extension cannot be built here")
    return ext


def int8_table(rows: int = 300, dim: int = 96) -> Int8WeightOnlyLinear:
    return Int8WeightOnlyLinear.from_weight(torch.randn(rows, dim, generator=gen(3)) * 0.3, None)


def test_int8_lookup_is_the_modules_bits(ext) -> None:  # noqa: ANN001
    embed = wrap_head(int8_table(), tied=True, dtype=torch.float32)
    lookup = embed.direct_lookup()
    assert lookup is not None
    for ids in (torch.tensor([7]), torch.tensor([[0, 299, 5], [17, 17, 128]])):
        got = lookup(ids)
        assert got.dtype == torch.float32 and got.shape == (*ids.shape, 96)
        assert torch.equal(got, embed(ids))


def test_int8_lookup_names_a_bad_id_and_answers_the_next(ext) -> None:  # noqa: ANN001
    embed = wrap_head(int8_table(), tied=True, dtype=torch.float32)
    lookup = embed.direct_lookup()
    for bad in (300, -1):
        with pytest.raises(RuntimeError, match=f"token id {bad} is outside the table's 300 rows"):
            lookup(torch.tensor([3, bad]))
    assert torch.equal(lookup(torch.tensor([3])), embed(torch.tensor([3])))
    table = embed.table
    with pytest.raises(RuntimeError, match="ids must be a 1-D int64"):
        ext.int8_embedding(torch.tensor([1], dtype=torch.int32), table.weight, table.scales)
    with pytest.raises(RuntimeError, match="scales must be bf16"):
        ext.int8_embedding(torch.tensor([1]), table.weight, table.scales.float())


def test_lookup_shortcut_only_where_forward_takes_it(ext) -> None:  # noqa: ANN001
    assert wrap_head(int8_table(), tied=True, dtype=torch.bfloat16).direct_lookup() is None
    int4 = Int4WeightOnlyLinear.from_weight(torch.randn(128, 64, generator=gen(4)), None,
                                            group_size=32)
    assert QuantizedEmbedding(int4, torch.float32).direct_lookup() is None


@pytest.mark.parametrize("rows", [1, 3, INT8_TILES_MIN_ROWS, 9])
def test_head_kernel_is_the_modules_bits(ext, rows: int) -> None:  # noqa: ANN001
    """Below the tiles' row count and from it (both int8 x int16 routes), fp32 rows."""
    linear = int8_table()
    head = wrap_head(linear, tied=False, dtype=torch.float32)
    kernel = linear.direct_rows_kernel()
    assert kernel is not None
    x = torch.randn(rows, 96, generator=gen(5)) * 3
    got = kernel(x)
    assert got.dtype == torch.float32 and torch.equal(got, head(x))


def test_head_kernel_hands_other_inputs_to_forward(ext) -> None:  # noqa: ANN001
    linear = int8_table()
    head = wrap_head(linear, tied=False, dtype=torch.float32)
    kernel = linear.direct_rows_kernel()
    x = torch.randn(2, 96, generator=gen(6))
    assert torch.equal(kernel(x.bfloat16()), head(x.bfloat16()))  # widened by forward
    assert torch.equal(kernel(x[0]), head(x[0]))  # one 1-D row
    linear.dense_min_rows = 2  # past the cut-over: forward's dense matmul
    assert torch.equal(kernel(x), head(x))


def test_head_kernel_only_for_fp32_heads(ext) -> None:  # noqa: ANN001
    body = int8_table()  # a body layer: bf16 in and out
    assert body.direct_rows_kernel() is None
    wrap_head(body, tied=False, dtype=torch.bfloat16)
    assert body.direct_rows_kernel() is None
    biased = Int8WeightOnlyLinear.from_weight(torch.randn(64, 32, generator=gen(7)),
                                              torch.ones(64))
    wrap_head(biased, tied=False, dtype=torch.float32)
    assert biased.direct_rows_kernel() is None
