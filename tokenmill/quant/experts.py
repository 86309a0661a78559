"""A mixture of experts' weights quantized per expert: each expert's gate/up and down
projections as weight-only int8 or int4 modules (:mod:`tokenmill.quant.linear`), multiplied by
the grouped path (:func:`tokenmill.kernels.moe.grouped_moe`), which calls only the experts a
step's tokens chose, each on its own tokens' rows with its module's own CPU kernel. Experts
with biases and their own gating (gpt-oss's) keep both: the biases in float, added to the
quantized products, and the gating handed to the grouped path."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.kernels.moe import Activation, grouped_moe, silu_gate
from tokenmill.models.moe import StackedExperts


class QuantizedExperts(nn.Module):
    """In place of a :class:`~tokenmill.models.moe.StackedExperts`: ``gate_up[e]`` computes
    expert ``e``'s ``[gate | up]`` rows, ``down[e]`` its down projection; ``b13`` ``[E, 2I]``
    and ``b2`` ``[E, H]`` their float biases where the experts have them, ``activation`` the
    gating (SiLU's by default)."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module],
                 activation: Activation = silu_gate, b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None) -> None:
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate_up modules but {len(down)} down modules")
        self.num_experts = len(gate_up)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.activation = activation
        self.register_buffer("b13", b13)
        self.register_buffer("b2", b2)

    @classmethod
    def from_stacked(cls, experts: StackedExperts,
                     quantize: Callable[[torch.Tensor], nn.Module]) -> QuantizedExperts:
        """Each expert's ``w13`` and ``w2`` slice through ``quantize`` (a float ``[out, in]``
        weight -> a module computing ``x @ w.T``), with the experts' ``activation``,
        ``w13_bias`` and ``w2_bias`` where they have them (gpt-oss); ValueError where it
        cannot take a shape."""
        n = experts.num_experts
        bias13, bias2 = (getattr(experts, name, None) for name in ("w13_bias", "w2_bias"))
        return cls([quantize(experts.w13[e].contiguous()) for e in range(n)],
                   [quantize(experts.w2[e].contiguous()) for e in range(n)],
                   getattr(experts, "activation", silu_gate),
                   None if bias13 is None else bias13.detach().clone(),
                   None if bias2 is None else bias2.detach().clone())

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """As ``StackedExperts.forward``: ``[T, H]``, the chosen experts' weighted sum."""
        b13, b2 = self.b13, self.b2
        return grouped_moe(
            x, lambda e, rows: _add(self.gate_up[e](rows), None if b13 is None else b13[e]),
            lambda e, rows: _add(self.down[e](rows), None if b2 is None else b2[e]),
            topk_weights, topk_ids, self.num_experts, self.activation)


def _add(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


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
