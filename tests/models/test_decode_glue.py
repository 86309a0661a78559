"""The decoder stack's SiLU-and-multiply (tokenmill/kernels/cpu/decode_kernels.h): explicit vector
lanes for whole lanes' worth of a row, one element at a time for the rest. Both must give the
same bits for the same input, whichever position it sits at, and agree with PyTorch's silu."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def ext():  # noqa: ANN201
    from tokenmill.kernels.cpu import extension_or_none

    ext = extension_or_none()
    if ext is None:
        pytest.skip("tokenmill's C++ extension cannot be built here")
    return ext


def gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=1).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_lanes_and_the_tail_compute_the_same_bits(ext, dtype: torch.dtype) -> None:  # noqa: ANN001
    """Row of 37 (two or four whole lanes, then a tail of 5 or 13): the tail's inputs are also
    put at the front, where the lanes compute them."""
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(24, generator=gen) * s for s in (0.05, 3, 30)])
    values[:4] = torch.tensor([0.0, -0.0, 88.5, -90.0])  # exp's clamps
    for start in range(0, values.numel() - 37, 7):
        gate = values[start:start + 37].clone()
        up = torch.randn(37, generator=gen)
        tail = slice(32, 37)
        front = gate.clone(), up.clone()
        front[0][:5], front[1][:5] = gate[tail], up[tail]
        a = ext.silu_mul(gate_up(gate[None], up[None]).to(dtype))
        b = ext.silu_mul(gate_up(front[0][None], front[1][None]).to(dtype))
        assert torch.equal(a[0, tail], b[0, :5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_matches_pytorch(ext, dtype: torch.dtype, rows: int) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(rows)
    gate = torch.randn(rows, 1536, generator=gen) * 4
    up = torch.randn(rows, 1536, generator=gen)
    got = ext.silu_mul(gate_up(gate, up).to(dtype)).float()
    g, u = gate.to(dtype), up.to(dtype)
    want = (F.silu(g.float()).to(dtype) * u).float()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert got.isnan().sum() == 0


def test_names_bad_input(ext) -> None:  # noqa: ANN001
    with pytest.raises(RuntimeError, match="gate_up must be a contiguous fp32 or bf16"):
        ext.silu_mul(torch.ones(2, 5))
    assert torch.equal(ext.silu_mul(torch.zeros(1, 4)), torch.zeros(1, 2))
