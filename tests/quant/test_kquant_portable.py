"""The K-quant kernels built for CPUs other than this one: AVX2 + FMA without AVX-512 (its
vpmaddwd path) and plain x86-64 (the portable loops) give the matmul within the activations'
rounding, as the AVX-512 build does (tests/quant/test_kquant.py)."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from kquant_helpers import (
    ALL_TYPES,
    act_block,
    activation_error_bound,
    make_blocks,
    reference_weight,
)

from tokenmill.kernels.cpu import clear_stale_build_lock

CSRC = Path(__file__).resolve().parents[2] / "tokenmill" / "kernels" / "cpu"
HERE = Path(__file__).resolve().parent / "csrc"
# -march for each build; x86-64: SSE2 only.
TARGETS = {"avx2": ["-march=haswell"], "portable": ["-march=x86-64", "-mtune=generic"]}


@pytest.fixture(scope="module", params=list(TARGETS))
def build(request: pytest.FixtureRequest):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the -march targets here are x86's")
    from torch.utils import cpp_extension

    sources = b"".join((CSRC / f).read_bytes() for f in ("kquant.h", "kquant_blocks.h",
                                                          "kquant_dot.h", "decode_kernels.h",
                                                          "thread_pool.h"))
    digest = hashlib.sha256(sources + (HERE / "kquant_portable.cpp").read_bytes()).hexdigest()
    name = f"tokenmill_kquant_{request.param}_{digest[:12]}"
    clear_stale_build_lock(name)
    return cpp_extension.load(name=name, sources=[str(HERE / "kquant_portable.cpp")],
                              extra_include_paths=[str(CSRC)],
                              extra_cflags=["-O2", *TARGETS[request.param]], verbose=False)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_within_activation_rounding(build, qtype) -> None:
    k = 576 if GGML_QUANT_SIZES[qtype][0] == 32 else 512
    blocks = make_blocks(qtype, 19, k, seed=3)
    w = reference_weight(blocks, qtype)
    table = torch.tensor([[int(qtype), 19]])
    torch.testing.assert_close(build.kquant_dequantize(torch.from_numpy(blocks), table, k, False),
                               w, rtol=1e-6, atol=0)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(9))
    y = build.kquant_linear(x, torch.from_numpy(blocks), table)
    assert ((y - x @ w.T).abs() <= activation_error_bound(x, w, act_block(qtype))).all()
