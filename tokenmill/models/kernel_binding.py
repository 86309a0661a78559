"""The kernels the shared blocks of :mod:`tokenmill.models.layers` run, chosen once per model.

A block holds the functions it calls (``RMSNorm._norm``, ``GatedMLP._act_down``, ...): PyTorch's
ops until :func:`bind_kernels` gives it another set, the fused Triton kernels of
:mod:`tokenmill.kernels.triton` for a model on CUDA where Triton is installed. So a block's
``forward`` tests nothing about the device or the quantization: that was decided here, when the
model was built. What remains at call time is what depends on the step itself: a tensor's
shape or strides (a 3-D input the Triton kernels do not take), and the Triton matmul's tile for
the step's row count (:mod:`tokenmill.models.linear`). Nothing here imports Triton on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.fp8_activation import QuantizedActivation
from tokenmill.kernels.moe import torch_moe
from tokenmill.models.linear import NormedInput, linear, norm_linear, silu_mul_linear
from tokenmill.utils import triton_module

M = TypeVar("M", bound=nn.Module)
Norm = Callable[..., tuple[Any, torch.Tensor]]  # (x, weight, eps, residual) -> (y, x + residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of ``x`` over its last dimension, in fp32 for low-precision inputs as HF does
    (normalized in fp32, rounded, then scaled in the input dtype)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def torch_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s) * weight, s)`` with ``s`` ``x + residual`` (``x`` for residual None)."""
    h = x if residual is None else residual + x
    return rms_norm(h, weight, eps), h


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused ``[.., gate | up]`` projection."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def torch_qk_norm(qk: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module,
                  num_q_heads: int) -> torch.Tensor:
    """Per-head norms of q and k (Qwen3) of ``qk`` ``[T, Hq + Hk, D]``: a new tensor."""
    return torch.cat([q_norm(qk[:, :num_q_heads]), k_norm(qk[:, num_q_heads:])], dim=1)


def torch_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of ``qk`` ``[T, H, D]`` by sign-folded ``sin``: three kernels."""
    half = qk.shape[-1] // 2
    swapped = torch.cat([qk[..., half:], qk[..., :half]], dim=-1)
    return torch.addcmul(qk * cos, swapped, sin)


def norm_then_linear(norm: Any, x: torch.Tensor, residual: torch.Tensor | None,
                     layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(norm(x + residual)), x + residual)``: the norm's kernel, then the layer's."""
    y, summed = norm.add_forward(x, residual)
    return layer(y), summed


def silu_then_down(mlp: Any, gate_up: torch.Tensor) -> torch.Tensor:
    """``mlp.down_proj(silu(gate) * up)``: the activation kernel, then the layer's."""
    return mlp.down_proj(mlp._act(gate_up))


@dataclass(frozen=True)
class Kernels:
    """One set of kernel functions the blocks are bound to; ``name`` says which."""

    name: str
    rms_norm: Norm
    rms_norm_fp8: Norm  # for a norm an Fp8Linear reads: its output quantized (or not: torch)
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    silu_mul_fp8: Callable[[torch.Tensor], torch.Tensor | QuantizedActivation]
    qk_norm: Callable[[torch.Tensor, nn.Module, nn.Module, int], torch.Tensor]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]  # (x, weight, bias) -> product
    # The norm's add and the norm computed in the next 16-bit Linear's product, and the SiLU
    # in the down projection's; None: no such kernel (the norm, the SiLU run first).
    norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    silu_down: Callable[[nn.Module, Any, torch.Tensor], torch.Tensor] | None = None
    # A mixture-of-experts feed-forward over stacked float experts (models/moe.py):
    # ``moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] float32,
    # topk_ids [T, k] int64) -> [T, H]`` in x's dtype, w13 = each expert's gate rows then its
    # up rows, SiLU gating, the k outputs summed with their weights. Default: the grouped
    # PyTorch path (tokenmill.kernels.moe), which reads only the experts the tokens chose.
    moe: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                  torch.Tensor] = torch_moe


TORCH_KERNELS = Kernels("torch", torch_add_rms_norm, torch_add_rms_norm, torch_silu_mul,
                        torch_silu_mul, torch_qk_norm, torch_rotary, F.linear)


# The CUDA set: each Triton kernel where the tensor is of the shape it takes, else PyTorch's.

def _triton_norm(kernel: Norm, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    if x.ndim == 2:
        return kernel(x, weight, eps, residual=residual)
    return torch_add_rms_norm(x, weight, eps, residual)


def _triton_act(kernel: Callable[[torch.Tensor], Any], gate_up: torch.Tensor) -> Any:
    return kernel(gate_up) if gate_up.ndim == 2 else torch_silu_mul(gate_up)


# (Each holds the kernel function, not its module: a bound model stays deep-copyable.)
def _triton_qk_norm(kernel: Callable[..., torch.Tensor], qk: torch.Tensor, q_norm: Any,
                    k_norm: Any, num_q_heads: int) -> torch.Tensor:
    if qk.stride(2) == 1:  # in place, one kernel
        return kernel(qk, q_norm.weight, k_norm.weight, num_q_heads, q_norm.eps)
    return torch_qk_norm(qk, q_norm, k_norm, num_q_heads)


def _triton_rotary(kernel: Callable[..., torch.Tensor], qk: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    return kernel(qk, cos, sin) if qk.stride(2) == 1 else torch_rotary(qk, cos, sin)


def _triton_moe(kernel: Callable[..., torch.Tensor], x: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    # The fused kernel takes rows of x, w13 and w2 with contiguous last dimensions.
    if x.ndim == 2 and x.stride(1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1:
        return kernel(x, w13, w2, topk_weights, topk_ids)
    return torch_moe(x, w13, w2, topk_weights, topk_ids)


def _tuned_linear(x: torch.Tensor | NormedInput, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product on CUDA (:func:`linear.linear`); for a :class:`NormedInput`, with the norm
    in the product's kernel where the tuning gives it a tile, else the norm's kernel first.
    ``summed`` is set on the input either way."""
    if not isinstance(x, NormedInput):
        return linear(x, weight, bias)
    if (fused := norm_linear(x.x, x.residual, x.weight, x.eps, weight, bias)) is not None:
        y, x.summed = fused
        return y
    normed, x.summed = x.norm(x.x, x.weight, x.eps, x.residual)
    return linear(normed, weight, bias)


def _fused_norm_linear(fused_with: nn.Module, norm: Any, x: torch.Tensor,
                       residual: torch.Tensor | None, layer: nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    # Bound for the Linear the norm fed when the model was built; a layer put in its place
    # since (a LoRA adapter, a quantized layer) gets the norm's output.
    if layer is not fused_with:
        return norm_then_linear(norm, x, residual, layer)
    operand = NormedInput(x, residual, norm.weight, norm.eps, norm._norm)
    return layer(operand), operand.summed  # through the call: the layer's hooks see it


def _fused_silu_down(fused_with: nn.Module, mlp: Any, gate_up: torch.Tensor) -> torch.Tensor:
    down = mlp.down_proj
    if down is fused_with and (out := silu_mul_linear(gate_up, down.weight,
                                                      down.bias)) is not None:
        return out  # a decode step's few rows on a GPU whose tuning says so
    return silu_then_down(mlp, gate_up)


@functools.cache
def triton_kernels() -> Kernels | None:
    """The fused Triton kernels (:mod:`tokenmill.kernels.triton.fused_ops`, and
    :mod:`tokenmill.kernels.triton.fused_moe` for the experts) as a set, or None where Triton
    is not installed."""
    ops = triton_module("tokenmill.kernels.triton.fused_ops")
    if ops is None:
        return None
    fused_moe = triton_module("tokenmill.kernels.triton.fused_moe").fused_moe
    p = functools.partial
    return with_tuned_matmul(Kernels(
        "triton", p(_triton_norm, ops.rms_norm), p(_triton_norm, ops.rms_norm_fp8),
        p(_triton_act, ops.silu_and_mul), p(_triton_act, ops.silu_and_mul_fp8),
        p(_triton_qk_norm, ops.head_rms_norm_), p(_triton_rotary, ops.rotary_), F.linear,
        moe=p(_triton_moe, fused_moe)))


def with_tuned_matmul(kernels: Kernels) -> Kernels:
    """``kernels`` with the products of :mod:`tokenmill.models.linear` (the Triton matmul where
    a CUDA GPU's tuning gives the step's rows a tile, else F.linear), the norm and the SiLU
    computed in that matmul where it runs."""
    return replace(kernels, linear=_tuned_linear, norm_linear=_fused_norm_linear,
                   silu_down=_fused_silu_down)


def kernels_for(device: torch.device | str) -> Kernels:
    """The set for a model on ``device``: Triton's on CUDA where installed, else PyTorch's."""
    if torch.device(device).type == "cuda" and (triton := triton_kernels()) is not None:
        return triton
    return TORCH_KERNELS


def bind_kernels(model: M, device: torch.device | str | None = None,
                 kernels: Kernels | None = None) -> M:
    """Give every block of ``model`` (each module with a ``use_kernels``) the kernels of
    ``kernels`` (default: those for ``device``, default the device of the model's first
    parameter). Returns ``model``."""
    if kernels is None:
        if device is None:
            param = next(model.parameters(), None)
            device = param.device if param is not None else "cpu"
        kernels = kernels_for(device)
    for module in model.modules():
        if callable(use := getattr(module, "use_kernels", None)):
            use(kernels)
    return model
