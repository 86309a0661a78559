"""Where a linear layer's product runs: ``F.linear`` (cuBLAS on a GPU, oneDNN on the CPU), or
on a GPU whose tuning file picks it for the product's rows and weight shape, the Triton matmul
of :mod:`tokenmill.kernels.triton.gemm`. Nothing here imports Triton: a run on the CPU never
does."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.utils import triton_module

if TYPE_CHECKING:
    from tokenmill.kernels.triton.gemm import GemmTile, GemmTuning

# The 16-bit products the Triton matmul computes; fp8 ones go through Fp8Linear.
MATMUL_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _gemm_tuning(device_index: int) -> GemmTuning | None:
    """The matmul tuning of a CUDA device (``triton_gemm.tuning_for_device``), or None where
    Triton is not installed."""
    gemm = triton_module("tokenmill.kernels.triton.gemm")
    return None if gemm is None else gemm.tuning_for_device(
        torch.cuda.get_device_name(device_index))


def gemm_tile(a: torch.Tensor, n: int, fp8: bool = False, k: int | None = None
              ) -> GemmTile | None:
    """The Triton launch for ``a`` (``[M, K]``; e4m3 with ``fp8``) times a ``[n, K]`` weight
    where the GPU's tuning gives one; None: cuBLAS (always off CUDA). ``k``: K, where ``a``
    is wider (the gate and up halves of a SiLU prologue)."""
    if not a.is_cuda:
        return None
    tuning = _gemm_tuning(a.device.index or 0)
    return None if tuning is None else tuning.tile_for(
        a.shape[0], n, a.shape[1] if k is None else k, fp8)


def _matmul_tile(x: torch.Tensor, weight: torch.Tensor, halves: int = 1) -> GemmTile | None:
    """The tuned Triton tile for ``x`` times a 16-bit ``weight`` ``[N, K]``, or None: cuBLAS.
    ``x`` is ``[M, K]``, or with ``halves`` 2 the ``[M, 2K]`` of a SiLU prologue."""
    if (x.ndim == 2 and x.dtype in MATMUL_DTYPES and isinstance(weight, torch.Tensor)
            and weight.dtype == x.dtype and x.shape[1] == halves * weight.shape[1]
            and x.stride(1) == 1 and weight.stride(1) == 1):
        return gemm_tile(x, weight.shape[0], k=weight.shape[1])
    return None


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; a 2-D 16-bit product on CUDA goes to the Triton matmul
    where the GPU's tuning picks it (a decode step's few rows)."""
    if (tile := _matmul_tile(x, weight)) is not None:
        from tokenmill.kernels.triton import gemm as triton_gemm

        return triton_gemm.matmul(x, weight, bias, tile)
    return F.linear(x, weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """A gated MLP's down projection of ``silu(gate) * up`` (``gate_up`` ``[M, 2K]``) in one
    Triton kernel, where the GPU's tuning picks the Triton matmul for ``[M, K]`` by
    ``weight``: the SiLU is computed as the product loads its operand, and the SiLU kernel is
    not launched. None elsewhere: the caller runs the two kernels."""
    if (tile := _matmul_tile(gate_up, weight, halves=2)) is None:
        return None
    from tokenmill.kernels.triton import gemm as triton_gemm

    return triton_gemm.matmul(gate_up, weight, bias, tile, silu_mul=True)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(F.linear(rms_norm(s) * norm_weight, weight, bias), s)`` with ``s`` ``x + residual``
    (``x`` itself for residual None) in one Triton kernel, where the GPU's tuning picks the
    Triton matmul for ``[M, K]`` by ``weight``: the norm (and the residual add) are computed
    as the product loads its operand, and no norm kernel is launched. None elsewhere: the
    caller runs the norm, then the product."""
    if (tile := _matmul_tile(x, weight)) is None or (
            residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                      or residual.stride(1) != 1)):
        return None
    from tokenmill.kernels.triton import gemm as triton_gemm

    summed = x if residual is None else torch.empty_like(x)
    norm = triton_gemm.NormPrologue(norm_weight, eps, residual,
                                    None if residual is None else summed)
    return triton_gemm.matmul(x, weight, bias, tile, norm=norm), summed


@dataclass(eq=False)
class NormedInput:
    """A linear layer's operand given as ``norm(x + residual)`` (``x`` for residual None), for
    a product that computes the add and the RMS norm (``weight``, ``eps``) as it loads it;
    ``norm`` is the norm's own kernel, for a product that cannot. The product sets
    ``summed`` to ``x + residual``: the residual stream the caller carries on."""

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    summed: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """``x``'s: the rows and width the product reads."""
        return self.x.shape
