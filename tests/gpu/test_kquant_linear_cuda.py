"""A K-quant layer on CUDA multiplies with the Triton matmul that reads the GGUF blocks as
stored (tokenmill.kernels.triton.kquant), not by dequantizing the weight a call; a layer with a
type that kernel lacks takes the dense path. Skips without CUDA (CI has none);
tests/quant/test_kquant_triton.py covers the kernel in the interpreter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from kquant_helpers import make_blocks, reference_weight  # noqa: E402

from tokenmill.quant.kquant import KQuantLinear  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")


def _layer(parts: list[tuple[Q, int]], k: int) -> tuple[KQuantLinear, torch.Tensor]:
    blocks = [make_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(parts)]
    w = torch.cat([reference_weight(b, t) for b, (t, _) in zip(blocks, parts, strict=True)])
    layer = KQuantLinear([(torch.from_numpy(b), t) for b, (t, _) in zip(blocks, parts,
                                                                         strict=True)], k, None)
    return layer.cuda(), w.cuda()


def test_mixed_k_quant_layer_runs_the_triton_matmul() -> None:
    layer, w = _layer([(Q.Q4_K, 64), (Q.Q6_K, 32), (Q.Q8_0, 32)], 512)
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert layer._cuda_matmul() is not None
    ref = x.float() @ w.T
    assert ((y.float() - ref).norm() / ref.norm()).item() < 2e-2


def test_a_type_without_triton_kernel_takes_the_dense_path() -> None:
    layer, w = _layer([(Q.Q3_K, 32)], 512)
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert layer._cuda_matmul() is None
    ref = x.float() @ w.T
    assert ((y.float() - ref).norm() / ref.norm()).item() < 2e-2
