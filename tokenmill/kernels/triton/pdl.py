"""Programmatic dependent launch (PDL) of the CUDA backend's Triton kernels: an experiment for
small-batch decode, on with ``TOKENMILL_PDL=1`` on GPUs of compute capability 9.0 or later
(Hopper), off by default.

A batch-1 decode step of an 8B dense model is ~200 kernels in a CUDA graph. Between two of them
the GPU does no useful work: the first kernel's last programs finish, its writes are flushed,
then the next kernel is launched and its programs are scheduled and set up. With PDL a kernel
launched with the programmatic-serialization attribute may be launched while the kernel
before it still runs, once every program of that kernel has signalled
(``griddepcontrol.launch_dependents``); it then waits (``griddepcontrol.wait``) until that
kernel has completed and its writes are visible.

Every kernel here does both as its first statements (:func:`pdl_start`): it waits, then
signals. So no kernel reads or writes memory before the kernel before it has completed, as
without PDL, and at most one kernel waits behind a running one. What overlaps is the launch,
the scheduling of the next kernel's programs and their set-up up to the wait. A kernel of
another library between two of ours (cuBLAS, PyTorch's) never signals early, so ours after it
starts when it completes, as before.

One thing may happen before the wait: the matmul's programs ask for the first bytes of their
rows of the weight to be brought into L2 (:func:`prefetch_l2`, ``TOKENMILL_PDL_PREFETCH_KB``
a program, 64 by default, 0 for none). Weights are never written, so this reads nothing that
the kernel before may still change. At batch 1 the kernels before a matmul (attention, norms)
leave HBM nearly idle; the matmul's weight stream then starts under them.

Imported by the Triton kernel modules only: it needs Triton.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from tokenmill import envs

ENV = "TOKENMILL_PDL"
PREFETCH_ENV = "TOKENMILL_PDL_PREFETCH_KB"
# The bytes one prefetch instruction brings into L2: a cache line.
LINE = 128


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel before it to complete, then
    let the kernel after it be launched. Nothing without (and in Triton's interpreter, which
    cannot run the instructions)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask for the lines at ``ptrs`` (where ``mask``) to be brought into L2 and kept there
    (evict-last), without waiting for them and without loading them into registers."""
    # A masked entry's address is 0, which the instruction skips.
    addr = tl.where(mask, ptrs.to(tl.int64), 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s64 p, $1, 0; @p prefetch.global.L2::evict_last [$1]; "
        "mov.u32 $0, 0; }", "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _device_settings(index: int) -> tuple[bool, int]:
    """(PDL on, the bytes a matmul program prefetches) for a CUDA device; the variables'
    ValueErrors name them."""
    if not envs.TOKENMILL_PDL or torch.cuda.get_device_capability(index) < (9, 0):
        return False, 0
    return True, envs.TOKENMILL_PDL_PREFETCH_KB << 10


def _settings(device: torch.device) -> tuple[bool, int]:
    if device.type != "cuda":
        return False, 0
    return _device_settings(device.index if device.index is not None
                            else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict[str, Any]:
    """The keyword arguments that launch a kernel with PDL on ``device`` (its ``PDL``
    constexpr and Triton's ``launch_pdl``), or none: off unless ``TOKENMILL_PDL`` asks for it,
    and off the GPUs without it (CPU tensors, compute capability below 9.0). Read once a
    device; :func:`reset` forgets it (tests)."""
    return {"PDL": True, "launch_pdl": True} if _settings(device)[0] else {}


def prefetch_lines(device: torch.device, rows: int, row_bytes: int) -> int:
    """Lines of :data:`LINE` bytes a matmul program prefetches from each of its ``rows`` rows
    of the weight (``row_bytes`` long) before its wait: the program's share of
    ``TOKENMILL_PDL_PREFETCH_KB``, a power of two (Triton's ranges are), at most the row;
    0 without PDL."""
    on, budget = _settings(device)
    lines = min(budget // (rows * LINE), triton.cdiv(row_bytes, LINE)) if on else 0
    return 0 if lines < 1 else 1 << (lines.bit_length() - 1)


def reset() -> None:
    """Read ``TOKENMILL_PDL`` and ``TOKENMILL_PDL_PREFETCH_KB`` again at the next launch."""
    _device_settings.cache_clear()
