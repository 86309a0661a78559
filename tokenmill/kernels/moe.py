"""Grouped mixture-of-experts on PyTorch ops: each expert a step's tokens chose runs once, on
the rows of the tokens that chose it; the experts nobody chose are never read.

So a decode step's cost follows the active parameters (top-k experts a token), not the total:
the rows of every ``(token, choice)`` pair are sorted by expert, each chosen expert multiplies
its contiguous run of rows with its own weights (float, or a weight-only int8/int4 module's
kernel), and each pair's output, scaled by its routing weight, is summed back per token in
top-k order (a fixed order: the same sum whatever shares the step).

:func:`torch_moe` has the signature of ``Kernels.moe`` (tokenmill.models.kernel_binding),
which a fused kernel (the Triton one on CUDA) may take over; :func:`grouped_moe` is the same
computation over per-expert callables, for experts held as quantized modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (expert index, rows [n, in]) -> rows [n, out]: one expert's projection.
ExpertProduct = Callable[[int, torch.Tensor], torch.Tensor]
# rows [n, 2I] ([gate | up]) -> rows [n, I]: the experts' gating.
Activation = Callable[[torch.Tensor], torch.Tensor]


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[.., gate | up]`` rows: the default experts' gating."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ExpertGroups:
    """The ``(token, choice)`` pairs of a step sorted by expert.

    ``order[i]`` is the flat pair index (``token * k + choice``) of sorted row ``i``;
    ``tokens[i]`` its token; ``counts[e]`` how many rows expert ``e`` has (in expert order).
    """

    order: torch.Tensor
    tokens: torch.Tensor
    counts: list[int]

    def runs(self) -> list[tuple[int, int, int]]:
        """``(expert, start, end)`` of each chosen expert's rows, in expert order."""
        out = []
        start = 0
        for expert, n in enumerate(self.counts):
            if n:
                out.append((expert, start, start + n))
                start += n
        return out


def expert_groups(topk_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort a step's ``[T, k]`` expert choices by expert (stable: a token's rows keep their
    order within an expert)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # One host sync a layer: the loop below needs each expert's row count on the host.
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(order, order // topk_ids.shape[1], counts)


def grouped_moe(x: torch.Tensor, gate_up: ExpertProduct, down: ExpertProduct,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, activation: Activation = silu_gate) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, j]``, for every token ``t`` of ``x`` ``[T, H]`` (``activation`` in place
    of the SiLU gating where given: a clamped SwiGLU).

    ``gate_up(e, rows)`` returns ``[n, 2I]`` (gate columns then up columns) and ``down(e,
    rows)`` ``[n, H]``; each is called once per expert that some token chose, never for the
    others. The routing weights multiply in fp32; the result is in ``x``'s dtype.
    """
    num_tokens, k = topk_ids.shape
    if num_tokens == 1:
        return _one_token_moe(x, gate_up, down, topk_weights, topk_ids, activation)
    groups = expert_groups(topk_ids, num_experts)
    sorted_weights = topk_weights.reshape(-1).float().index_select(0, groups.order)
    pairs = x.new_empty((num_tokens * k, x.shape[1]), dtype=torch.float32)
    for expert, start, end in groups.runs():
        rows = x.index_select(0, groups.tokens[start:end])
        y = down(expert, activation(gate_up(expert, rows))).float()
        pairs.index_copy_(0, groups.order[start:end], y.mul_(sorted_weights[start:end, None]))
    return pairs.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)


def _one_token_moe(x: torch.Tensor, gate_up: ExpertProduct, down: ExpertProduct,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   activation: Activation) -> torch.Tensor:
    """:func:`grouped_moe` of a single token (a single-stream decode step): its k experts in
    turn, with none of the sorting and gathering a batch needs (a dozen fewer small ops a
    layer); the same sum, in top-k order in fp32."""
    out = None
    weights = topk_weights[0].float()
    for j, expert in enumerate(topk_ids[0].tolist()):
        y = down(expert, activation(gate_up(expert, x))).float().mul_(weights[j])
        out = y if out is None else out.add_(y)
    assert out is not None
    return out.to(x.dtype)


def torch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: Activation = silu_gate,
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE feed-forward of ``x`` ``[T, H]`` over stacked float experts, SiLU-gated unless
    another ``activation`` is given.

    ``w13`` ``[E, 2I, H]`` holds each expert's gate rows then its up rows, ``w2`` ``[E, H, I]``
    its down projection, ``b13`` ``[E, 2I]`` and ``b2`` ``[E, H]`` their biases if any;
    ``topk_weights`` ``[T, k]`` (float32) and ``topk_ids`` ``[T, k]`` (int64) are the router's
    choices. Returns ``[T, H]`` in ``x``'s dtype. Only the chosen experts' slices of the
    weights are read (:func:`grouped_moe`).
    """
    return grouped_moe(x, lambda e, rows: F.linear(rows, w13[e], None if b13 is None else b13[e]),
                       lambda e, rows: F.linear(rows, w2[e], None if b2 is None else b2[e]),
                       topk_weights, topk_ids, w13.shape[0], activation)
