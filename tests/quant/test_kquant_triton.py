"""The Triton K-quant matmuls (tokenmill/kernels/triton/kquant.py) against ``gguf``'s reference
dequantization. Without a GPU they run in Triton's interpreter (fp32 and fp16 activations; the
interpreter gets bf16 wrong); on CUDA a bf16 check runs too. Q8_0, Q4_0, Q4_1, Q5_0
and Q5_1 weights come from ``gguf.quants.quantize``; the package cannot quantize K-types, so their blocks are random bytes
with finite fp16 scales (every byte pattern of the rest is a valid block)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from tokenmill.kernels.triton.kquant import (  # noqa: E402
    KQUANT_TYPES,
    kquant_matmul,
    kquant_matmul_segments,
    kquant_type,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# Types gguf.quants.quantize makes; the K-types are random valid blocks.
GGUF_QUANTIZES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# Byte offsets of each block's fp16 scales (d, and dmin for Q4_K/Q5_K).
FP16_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}


def random_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """``[n, k / QK * block_bytes]`` uint8: valid blocks of ``qtype`` with scales ~1e-2."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if qtype in GGUF_QUANTIZES:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    blocks = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for off in FP16_OFFSETS[qtype]:
        scales = (rng.random((n, k // elems)) * 0.02 + 1e-3).astype(np.float16)
        blocks[:, :, off:off + 2] = scales.view(np.uint8).reshape(n, k // elems, 2)
    return blocks.reshape(n, -1)


def _check(qtype: Q, m: int, n: int, k: int, dtype: torch.dtype, **tile: int) -> None:
    raw = random_blocks(qtype, n, k, seed=m * 7 + n + k)
    ref_w = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = kquant_matmul(x.to(DEVICE), torch.from_numpy(raw).to(DEVICE), qtype.name, **tile)
    want = x.double() @ ref_w.double().T
    assert got.dtype == dtype and got.shape == (m, n)
    err = ((got.double().cpu() - want).norm() / want.norm()).item()
    assert err <= (1e-6 if dtype == torch.float32 else 2e-3), err


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m, n, k", [(1, 40, 512), (19, 64, 256)])  # decode; rows and N masked
def test_matches_gguf_dequantize_fp32(qtype: Q, m: int, n: int, k: int) -> None:
    _check(qtype, m, n, k, torch.float32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_gguf_dequantize_fp16(qtype: Q) -> None:
    _check(qtype, 5, 48, 512, torch.float16, block_m=16, block_n=16)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_32_element_types_k_not_a_multiple_of_256(qtype: Q) -> None:
    _check(qtype, 3, 24, 96, torch.float32)  # SmolLM2's 576-wide rows are such


def test_leading_dims_and_empty_batch() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q4_K, 32, 256, seed=3)).to(DEVICE)
    x = torch.randn(2, 3, 256).to(DEVICE)
    out = kquant_matmul(x, raw, "Q4_K")
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out.reshape(6, 32), kquant_matmul(x.reshape(6, 256), raw, "Q4_K"))
    assert kquant_matmul(x[:0].reshape(0, 256), raw, "Q4_K").shape == (0, 32)


def test_types_by_name_and_ggml_id() -> None:
    for qtype in TYPES:
        t = kquant_type(int(qtype))
        assert t.name == qtype.name and kquant_type(qtype.name) is t
        assert (t.block_elems, t.block_bytes) == gguf.GGML_QUANT_SIZES[qtype]
    assert set(KQUANT_TYPES) == {t.name for t in TYPES}


def test_bad_input_is_refused_with_the_supported_types() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q6_K, 8, 256, seed=1))
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="Q2_K has no Triton kernel; supported: Q4_0, "):
        kquant_matmul(x, raw, Q.Q2_K)
    with pytest.raises(ValueError, match="210 bytes a row, got 144"):
        kquant_matmul(x, raw[:, :144].contiguous(), "Q6_K")
    with pytest.raises(ValueError, match="not a multiple"):
        kquant_matmul(torch.randn(2, 200), raw, "Q6_K")
    with pytest.raises(ValueError, match="uint8"):
        kquant_matmul(x, raw.to(torch.int16), "Q6_K")
    # the next ordinary product is answered as before
    _check(Q.Q6_K, 2, 8, 256, torch.float32)


def test_segments_of_mixed_types_as_kquant_linear_holds_them() -> None:
    """A fused projection of a Q4_K_M file: Q4_K rows then Q6_K rows, one flat byte tensor."""
    k = 512
    parts = [(Q.Q4_K, random_blocks(Q.Q4_K, 24, k, seed=5)),
             (Q.Q6_K, random_blocks(Q.Q6_K, 8, k, seed=6)),
    (Q.Q5_0, random_blocks(Q.Q5_0, 8, k, seed=8)),
             (Q.Q8_0, random_blocks(Q.Q8_0, 16, k, seed=7))]
    flat = torch.from_numpy(np.concatenate([b.reshape(-1) for _, b in parts])).to(DEVICE)
    segments = torch.tensor([(int(t), b.shape[0]) for t, b in parts])
    ref_w = torch.from_numpy(np.concatenate([quants.dequantize(b, t) for t, b in parts]))
    x = torch.randn(3, k)
    got = kquant_matmul_segments(x.to(DEVICE), flat, segments).cpu()
    want = x.double() @ ref_w.double().T
    assert got.shape == (3, 56)
    assert ((got.double() - want).norm() / want.norm()).item() <= 1e-6
    with pytest.raises(ValueError, match="IQ4_XS has no Triton kernel"):
        kquant_matmul_segments(x.to(DEVICE), flat, [(int(Q.IQ4_XS), 56)])
    with pytest.raises(ValueError, match="cover"):
        kquant_matmul_segments(x.to(DEVICE), flat, segments[:2])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (bf16 on the tensor cores)")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_on_the_gpu(qtype: Q) -> None:
    _check(qtype, 64, 256, 1024, torch.bfloat16, block_m=64, block_n=64)
    _check(qtype, 1, 256, 1024, torch.bfloat16)
