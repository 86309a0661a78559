"""Process groups of tensor parallelism and the collectives the sharded model calls.

One process per rank, rank 0 being the engine. :func:`init_distributed` joins the TP group
(NCCL on CUDA, gloo on the CPU) and a gloo group for control messages (start-up handshakes,
each step's broadcast), which stays on the CPU even when the TP group is NCCL. Until it is
called, and after :func:`destroy_distributed`, this process is rank 0 of 1: the collectives
return their input untouched, so single-process code pays one function call and nothing more.

The groups live in one module-level object because they belong to the process, not to a
step: every layer of the model reaches the same group, as in vLLM and Megatron.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# The control group waits for the engine's next step, however long the engine idles (an HTTP
# server with no traffic): gloo's default of 30 minutes would break idle workers. A dead peer
# still fails at once, when its sockets close.
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class _TPGroups:
    rank: int
    size: int
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup


_groups: _TPGroups | None = None
# Set inside unsharded(): this thread builds models for one process despite _groups.
_unsharded: ContextVar[bool] = ContextVar("tokenmill_unsharded", default=False)


@contextmanager
def unsharded() -> Iterator[None]:
    """Within this block the process counts as rank 0 of 1, whatever group it belongs to:
    a one-process engine builds whole models even next to a tensor-parallel one (models
    read the rank count when built and keep it)."""
    token = _unsharded.set(True)
    try:
        yield
    finally:
        _unsharded.reset(token)


def _active() -> _TPGroups | None:
    return None if _unsharded.get() else _groups


def init_distributed(rank: int, size: int, store: dist.Store, device: torch.device,
                     timeout: timedelta) -> None:
    """Join the TP group as ``rank`` of ``size`` through ``store`` (a TCPStore rank 0 hosts).

    ``timeout`` bounds each collective of the TP group: a peer that stops answering turns
    into an error instead of a hang.
    """
    global _groups
    if _groups is not None:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _groups = _TPGroups(rank, size, dist.group.WORLD, cpu_group)


def in_tp_group() -> bool:
    """Whether this process has joined a tensor-parallel group (and not left it)."""
    return _groups is not None


def destroy_distributed() -> None:
    """Leave the groups (if any); this process is rank 0 of 1 again."""
    global _groups
    if _groups is None:
        return
    _groups = None
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    """This process's rank in the TP group (0 when not distributed)."""
    groups = _active()
    return 0 if groups is None else groups.rank


def tp_size() -> int:
    """Number of ranks sharing the model (1 when not distributed)."""
    groups = _active()
    return 1 if groups is None else groups.size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks, in place; ``x`` itself at size 1."""
    groups = _active()
    if groups is None or groups.size == 1:
        return x
    dist.all_reduce(x, group=groups.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order; ``x`` itself at size 1."""
    groups = _active()
    if groups is None or groups.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(groups.size)]
    dist.all_gather(parts, x, group=groups.group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: object = None) -> object:
    """Rank 0's ``obj`` on every rank, over the CPU control group (the others pass nothing)."""
    assert _groups is not None, "broadcast_object needs init_distributed"
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_groups.cpu_group)
    return box[0]


def all_reduce_min(value: int) -> int:
    """The smallest ``value`` over the ranks, over the CPU control group."""
    assert _groups is not None, "all_reduce_min needs init_distributed"
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_groups.cpu_group)
    return int(t.item())
