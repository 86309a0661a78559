"""The K-quant kernels (tokenmill/kernels/cpu/kquant.h) and KQuantLinear against gguf's own
dequantization: for every block type, ``x @ dequantize(blocks).T`` in fp32 within the error the
int8 activations can make, and the decoded weights equal to gguf's."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from kquant_helpers import (
    ALL_TYPES,
    act_block,
    activation_error_bound,
    make_blocks,
    reference_weight,
)

from tokenmill.kernels.cpu import load_extension
from tokenmill.quant.kquant import KQuantLinear, check_kquant_type


@pytest.fixture(scope="module")
def ext():
    return load_extension()


def _cols(qtype: Q) -> int:
    # 576 for the 32-blocks: two chunks of 256 and a tail of 64 (SmolLM2's hidden size).
    return 576 if GGML_QUANT_SIZES[qtype][0] == 32 else 512


def _table(*segments: tuple[Q, int]) -> torch.Tensor:
    return torch.tensor([(int(t), n) for t, n in segments], dtype=torch.int64)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf(ext, qtype: Q) -> None:
    blocks = make_blocks(qtype, 7, _cols(qtype), seed=1)
    got = ext.kquant_dequantize(torch.from_numpy(blocks), _table((qtype, 7)), _cols(qtype))
    torch.testing.assert_close(got, reference_weight(blocks, qtype), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_within_activation_rounding(ext, qtype: Q, rows: int) -> None:
    n, k = 37, _cols(qtype)
    blocks = make_blocks(qtype, n, k, seed=2)
    w = reference_weight(blocks, qtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 5] *= 20  # an outlier channel, as LLM activations have
    y = ext.kquant_linear(x, torch.from_numpy(blocks), _table((qtype, n)))
    ref = x @ w.T
    bound = activation_error_bound(x, w, act_block(qtype))
    err = (y - ref).abs()
    assert (err <= bound).all(), f"{qtype.name}: worst excess {(err - bound).max():.3g}"
    # and not trivially: the error is of the activation rounding's size, not zero
    assert err.max() > 0


def test_rows_do_not_change_each_other(ext) -> None:
    """A row's result does not depend on the other rows of the call (batch invariance)."""
    blocks = torch.from_numpy(make_blocks(Q.Q4_K, 40, 768, seed=3))
    table = _table((Q.Q4_K, 40))
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(3))
    full = ext.kquant_linear(x, blocks, table)
    for i in (0, 4, 8):
        assert torch.equal(ext.kquant_linear(x[i:i + 1], blocks, table), full[i:i + 1])


def test_mixed_segments_of_one_layer(ext) -> None:
    """A fused projection whose parts are stored in different types (Q4_K_M's q/k/v)."""
    k = 512
    parts = [(Q.Q4_K, 24), (Q.Q6_K, 8), (Q.Q8_0, 16), (Q.Q5_0, 8)]
    blocks = [make_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(parts)]
    w = torch.cat([reference_weight(b, t) for b, (t, _) in zip(blocks, parts, strict=True)])
    flat = torch.cat([torch.from_numpy(b).reshape(-1) for b in blocks])
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4))
    y = ext.kquant_linear(x, flat, _table(*parts))
    bound = activation_error_bound(x, w, 32) + activation_error_bound(x, w, 256)
    assert ((y - x @ w.T).abs() <= bound).all()
    torch.testing.assert_close(ext.kquant_dequantize(flat, _table(*parts), k), w,
                               rtol=1e-6, atol=0)


def test_bf16_activations_in_and_out(ext) -> None:
    blocks = make_blocks(Q.Q5_K, 21, 256, seed=5)
    w = reference_weight(blocks, Q.Q5_K)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = ext.kquant_linear(x, torch.from_numpy(blocks), _table((Q.Q5_K, 21)))
    assert y.dtype == torch.bfloat16
    ref = x.float() @ w.T
    bound = activation_error_bound(x.float(), w, 256) + ref.abs() * 2**-8
    assert ((y.float() - ref).abs() <= bound).all()


def test_bad_blocks_are_refused(ext) -> None:
    blocks = torch.from_numpy(make_blocks(Q.Q4_K, 4, 256, seed=6))
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="bytes of blocks"):
        ext.kquant_linear(x, blocks[:3], _table((Q.Q4_K, 4)))
    with pytest.raises(RuntimeError, match="no kernel for ggml type 16"):
        ext.kquant_linear(x, blocks, _table((Q.IQ2_XXS, 4)))
    with pytest.raises(RuntimeError, match="whole blocks of 256"):
        ext.kquant_linear(torch.randn(1, 128), blocks, _table((Q.Q4_K, 4)))


def test_module_kernel_and_dense_paths(ext) -> None:
    k, parts = 512, [(Q.Q4_K, 16), (Q.Q6_K, 16)]
    blocks = [torch.from_numpy(make_blocks(t, n, k, seed=7 + i)) for i, (t, n) in enumerate(parts)]
    bias = torch.randn(32)
    layer = KQuantLinear([(b, t) for b, (t, _) in zip(blocks, parts, strict=True)], k, bias)
    assert layer.type_names() == ["Q4_K", "Q6_K"] and layer.out_features == 32
    w = torch.cat([reference_weight(b.numpy(), t) for b, (t, _) in zip(blocks, parts,
                                                                         strict=True)])
    torch.testing.assert_close(layer.dequantize(), w, rtol=1e-6, atol=0)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(8))
    ref = x @ w.T + bias
    kernel = layer(x)
    layer.dense_min_rows = 1
    dense = layer(x)
    assert kernel.shape == dense.shape == (2, 3, 32)
    # both within the bf16 rounding of activations and outputs (the other int layers' too)
    for y in (kernel, dense):
        torch.testing.assert_close(y, ref, rtol=0.03, atol=0.03 * ref.abs().max().item())


def test_refused_type_names_itself_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"IQ2_XS has no CPU kernel.*Q4_K.*Q6_K"):
        check_kquant_type(Q.IQ2_XS, "model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="IQ3_S"):
        KQuantLinear([(torch.zeros(1, 110, dtype=torch.uint8), Q.IQ3_S)], 256, None)
