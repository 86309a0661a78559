"""A projection with the low-rank updates of several adapters, each on its own rows.

:class:`LoRALinear` wraps one of the model's projections (any kind: 16- or 32-bit, int8,
int4, fp8). It holds ``max_loras`` device slots; slot ``s`` keeps one adapter's stacked ``A``
matrices (``[parts * max_rank, in]``) and its ``B`` matrices laid block-diagonally, transposed
(``[parts * max_rank, out]``, scale folded in), zero where the adapter has no matrix or a
smaller rank. A fused projection (qkv, gate-up) thus computes every part's update with two
products. The step's :class:`LoRAStep` says which rows run which slot; rows of requests
without an adapter get the base product alone, and a step with no adapter rows is the base
layer's call and nothing else.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRAStep:
    """Which rows of the step's flat batch run which adapter slot (rows absent: none).

    ``runs`` are ``(slot, first row, end row)`` triples of consecutive rows. In the layers'
    own products one run (the usual case: one adapter, or the scheduler's grouping left one)
    is computed on its rows alone; several are computed together: every row times every
    slot's ``A`` in one product, each row's other slots masked out, then one product with
    every slot's ``B``. That is two matmuls a projection whatever the number of adapters
    (each a few-row product otherwise, with its own dispatch), for ``max_loras`` times the
    low-rank work, which is small beside the base product. The fused CPU stack reads
    ``row_slots`` and computes each row's own slot only (tokenmill/kernels/cpu/lora_kernels.h).
    """

    def __init__(self, runs: list[list[int]], num_rows: int, num_slots: int,
                 device: torch.device) -> None:
        self.runs = tuple(x for run in runs for x in run)
        self.num_slots = num_slots
        self.device = device
        # Each row's slot, -1 for none (int32 on the CPU: what the fused CPU stack reads).
        self.row_slots = torch.full((num_rows,), -1, dtype=torch.int32)
        for slot, start, stop in runs:
            self.row_slots[start:stop] = slot
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    @property
    def single(self) -> tuple[int, int, int] | None:
        """``(slot, start, stop)`` when the step has one run."""
        return self.runs if len(self.runs) == 3 else None  # type: ignore[return-value]

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, num_slots * width]``: 1 in the ``width`` columns of each row's own slot
        (none for rows without an adapter); made once a step per width."""
        key = (width, dtype)
        mask = self._masks.get(key)
        if mask is None:
            slots = torch.arange(self.num_slots, dtype=torch.int32)
            onehot = (self.row_slots.unsqueeze(1) == slots).to(dtype)
            mask = self._masks[key] = onehot.repeat_interleave(width, dim=1).to(self.device)
        return mask

    @classmethod
    def from_row_slots(cls, row_slots: list[tuple[int, int, int]], num_rows: int,
                       num_slots: int, device: torch.device) -> LoRAStep | None:
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
        return cls(runs, num_rows, num_slots, device) if runs else None


class StepContext:
    """The step every LoRA layer of a model reads: set by the runner before the forward pass,
    cleared after (None: the base model alone, as in graph capture and profiling)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRALinear(nn.Module):
    """``base(x)`` plus, on each slot's rows, ``B_slot @ A_slot @ x``.

    ``parts`` are the output widths of the projections fused in ``base`` (q, k, v; gate, up;
    one part otherwise), each adapted by its own ``A``/``B`` pair. ``lora_a`` is
    ``[slots, width, in]`` and ``lora_b`` ``[slots, width, out]`` (``width``: parts x
    max_rank; ``B`` transposed, so that its rows run along the outputs), so that every slot
    together is a plain ``[slots * width, in]`` and ``[slots * width, out]`` matrix.
    """

    def __init__(self, base: nn.Module, in_features: int, parts: tuple[int, ...],
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 context: StepContext) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.max_rank = max_rank
        self.context = context
        self.width = len(parts) * max_rank
        self.lora_a = nn.Parameter(torch.zeros(max_loras, self.width, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.lora_b = nn.Parameter(torch.zeros(max_loras, self.width, sum(parts), dtype=dtype,
                                               device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.context.step
        if step is None:
            return y
        a, b = self.lora_a, self.lora_b
        if (single := step.single) is not None:
            slot, start, stop = single
            rows = x[start:stop].to(a.dtype)
            y[start:stop] += ((rows @ a[slot].t()) @ b[slot]).to(y.dtype)
            return y
        every = a.shape[0] * self.width
        h = x.to(a.dtype) @ a.view(every, -1).t()
        h.mul_(step.mask(self.width, a.dtype))
        y += (h @ b.view(every, -1)).to(y.dtype)
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
        self.lora_b[slot, col:col + rank, row:row + self.parts[part]].copy_(b.t())

    def extra_repr(self) -> str:
        return (f"slots={self.lora_a.shape[0]}, parts={self.parts}, "
                f"max_rank={self.max_rank}")
