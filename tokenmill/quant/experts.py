"""A mixture of experts' weights quantized per expert: each expert's gate/up and down
projections as weight-only int8 or int4 modules (:mod:`tokenmill.quant.linear`), multiplied by
the grouped path (:func:`tokenmill.kernels.moe.grouped_moe`), which calls only the experts a
step's tokens chose, each on its own tokens' rows with its module's own CPU kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.kernels.moe import grouped_moe
from tokenmill.models.moe import StackedExperts


class QuantizedExperts(nn.Module):
    """In place of a :class:`~tokenmill.models.moe.StackedExperts`: ``gate_up[e]`` computes
    expert ``e``'s ``[gate | up]`` rows, ``down[e]`` its down projection."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate_up modules but {len(down)} down modules")
        self.num_experts = len(gate_up)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    @classmethod
    def from_stacked(cls, experts: StackedExperts,
                     quantize: Callable[[torch.Tensor], nn.Module]) -> QuantizedExperts:
        """Each expert's ``w13`` and ``w2`` slice through ``quantize`` (a float ``[out, in]``
        weight -> a module computing ``x @ w.T``); ValueError where it cannot take a shape,
        or where the experts compute more than the SiLU-gated stacks (gpt-oss's biases and
        clamped SwiGLU: kept in float rather than run without them)."""
        if type(experts).forward is not StackedExperts.forward:
            raise ValueError(f"{type(experts).__name__} computes more than SiLU-gated stacked "
                             "experts (biases, another gating): no quantized path")
        n = experts.num_experts
        return cls([quantize(experts.w13[e].contiguous()) for e in range(n)],
                   [quantize(experts.w2[e].contiguous()) for e in range(n)])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """As ``StackedExperts.forward``: ``[T, H]``, the chosen experts' weighted sum."""
        return grouped_moe(x, lambda e, rows: self.gate_up[e](rows),
                           lambda e, rows: self.down[e](rows), topk_weights, topk_ids,
                           self.num_experts)


def quantize_experts(model: nn.Module, quantize: Callable[[torch.Tensor], nn.Module],
                     kept_float: dict[str, str]) -> int:
    """Replace every :class:`StackedExperts` of ``model`` by :class:`QuantizedExperts` built
    with ``quantize``; those it cannot take stay float, their names and the reason added to
    ``kept_float``. Returns how many were replaced."""
    names = [name for name, m in model.named_modules() if isinstance(m, StackedExperts)]
    for name in names:
        try:
            quantized = QuantizedExperts.from_stacked(model.get_submodule(name), quantize)
        except ValueError as e:
            kept_float[name] = str(e)
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, quantized)  # the float stacks are freed
    return len(names) - sum(name in kept_float for name in names)
