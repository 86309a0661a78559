"""Small helpers every layer may use. They import nothing from tokenmill, and torch only when
called (the scheduler and the block pool stay free of torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def host_tensor(data: object, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` without a stream sync on CUDA.

    A copy from pageable host memory waits for the GPU to finish its queued work first; from
    pinned memory it is queued behind that work instead, so the host can go on preparing the
    step while the previous one still runs.
    """
    import torch

    t = torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
