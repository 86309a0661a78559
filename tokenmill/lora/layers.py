"""A projection with the low-rank updates of several adapters, each on its own rows.

:class:`LoRALinear` wraps one of the model's projections (any kind: 16- or 32-bit, int8,
int4, fp8). It holds ``max_loras`` device slots; slot ``s`` keeps one adapter's stacked ``A``
matrices (``[parts * max_rank, in]``) and its ``B`` matrices laid block-diagonally
(``[out, parts * max_rank]``, scale folded in), zero where the adapter has no matrix or a
smaller rank. A fused projection (qkv, gate-up) thus computes every part's update with two
products. The step's :class:`LoRAStep` says which rows run which slot; rows of requests
without an adapter get the base product alone, and a step with no adapter rows is the base
layer's call and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class SlotRows:
    """The rows of one step that run slot ``slot``: ``start``/``stop`` when they are one run
    of consecutive rows, else ``index`` (on the model's device)."""

    slot: int
    start: int = 0
    stop: int = 0
    index: torch.Tensor | None = None


@dataclass(frozen=True)
class LoRAStep:
    """Which rows of the step's flat batch run which adapter slot (rows absent: none):
    ``groups`` one per slot, for the layers' products; ``runs`` the same as flat
    ``(slot, first row, end row)`` triples of consecutive rows, for the fused CPU stack."""

    groups: tuple[SlotRows, ...]
    runs: tuple[int, ...]

    @classmethod
    def from_row_slots(cls, row_slots: list[tuple[int, int, int]],
                       device: torch.device) -> LoRAStep | None:
        """From ``(first row, row count, slot)`` of each request with an adapter, in row
        order; None when there is none."""
        runs: list[list[int]] = []  # [slot, start, stop], neighbours of one slot merged
        for row0, n, slot in row_slots:
            if not n:
                continue
            if runs and runs[-1][0] == slot and runs[-1][2] == row0:
                runs[-1][2] += n
            else:
                runs.append([slot, row0, row0 + n])
        by_slot: dict[int, list[list[int]]] = {}
        for run in runs:
            by_slot.setdefault(run[0], []).append(run)
        groups = []
        for slot, own in by_slot.items():
            if len(own) == 1:
                groups.append(SlotRows(slot, own[0][1], own[0][2]))
            else:
                rows = [r for _, start, stop in own for r in range(start, stop)]
                groups.append(SlotRows(slot, index=torch.tensor(rows, dtype=torch.int64,
                                                                device=device)))
        flat = tuple(x for run in runs for x in run)
        return cls(tuple(groups), flat) if groups else None


class StepContext:
    """The step every LoRA layer of a model reads: set by the runner before the forward pass,
    cleared after (None: the base model alone, as in graph capture and profiling)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRALinear(nn.Module):
    """``base(x)`` plus, on each slot's rows, ``B_slot @ A_slot @ x``.

    ``parts`` are the output widths of the projections fused in ``base`` (q, k, v; gate, up;
    one part otherwise), each adapted by its own ``A``/``B`` pair.
    """

    def __init__(self, base: nn.Module, in_features: int, parts: tuple[int, ...],
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 context: StepContext) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.max_rank = max_rank
        self.context = context
        width = len(parts) * max_rank
        self.lora_a = nn.Parameter(torch.zeros(max_loras, width, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.lora_b = nn.Parameter(torch.zeros(max_loras, sum(parts), width, dtype=dtype,
                                               device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.context.step
        if step is None:
            return y
        for group in step.groups:
            a, b = self.lora_a[group.slot], self.lora_b[group.slot]
            if group.index is None:
                rows = x[group.start:group.stop].to(a.dtype)
                delta = (rows @ a.t()) @ b.t()
                y[group.start:group.stop] += delta.to(y.dtype)
            else:
                rows = x.index_select(0, group.index).to(a.dtype)
                delta = (rows @ a.t()) @ b.t()
                y.index_add_(0, group.index, delta.to(y.dtype))
        return y

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put one part's ``a`` ``[r, in]`` and scaled ``b`` ``[part width, r]`` (this rank's
        slices) in ``slot``."""
        rank = a.shape[0]
        col = part * self.max_rank
        row = sum(self.parts[:part])
        self.lora_a[slot, col:col + rank].copy_(a)
        self.lora_b[slot, row:row + self.parts[part], col:col + rank].copy_(b)

    def extra_repr(self) -> str:
        slots, _, width = self.lora_b.shape
        return f"slots={slots}, parts={self.parts}, max_rank={self.max_rank}"
