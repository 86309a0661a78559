"""Small helpers every layer may use. They import nothing from tokenmill but its environment
variables (``tokenmill.envs``), and torch only when called (the scheduler and the block pool
stay free of torch)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import importlib
import itertools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from tokenmill import envs

if TYPE_CHECKING:
    import torch


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now into the garbage collector's permanent
    generation; returns how many. Call it where a long-running process has finished starting
    (the model, the tokenizer and the app loaded): none of that is ever garbage, yet without
    this each full collection walks all of it, and it runs in the middle of whatever step
    allocated last: 100-108 ms at ~227,000 objects at batch 256 on the 2-core EPYC, 8 ms frozen
    (benchmarks/gc_pauses.py). vLLM and SGLang freeze after loading too.
    ``TOKENMILL_GC_FREEZE=0`` turns it off (returns 0)."""
    if not envs.TOKENMILL_GC_FREEZE:
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def optional_positive_ints(entry: dict, keys: Sequence[str], at: str) -> dict[str, int | None]:
    """``entry``'s ``keys``, each null (None) or a positive integer, as in a tuning file's
    rule; ValueError names ``at`` and the key."""
    out: dict[str, int | None] = {}
    for key in keys:
        value = entry.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"{at}: {key} must be null or a positive integer, got {value!r}")
        out[key] = value
    return out


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """tokenmill's module of Triton kernels ``name``, imported on first use (so a run on the
    CPU never imports Triton); None where Triton is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class ListSlice(Sequence[int]):
    """``items[start:end]`` without copying: a read-only view of a list that is only appended
    to while the view is in use. Sampling takes every row's prompt and output ids each step but
    reads them only for the rows with penalties; copying them all cost O(context) per row."""

    __slots__ = ("_items", "_start", "_end")

    def __init__(self, items: list[int], start: int, end: int | None = None) -> None:
        self._items, self._start = items, start
        self._end = len(items) if end is None else end

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        if isinstance(index, slice):
            return self._items[self._start:self._end][index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("ListSlice index out of range")
        return self._items[self._start + index]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._items, self._start, self._end)


def host_tensor(data: object, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` without a stream sync on CUDA.

    A copy from pageable host memory waits for the GPU to finish its queued work first; from
    pinned memory it is queued behind that work instead, so the host can go on preparing the
    step while the previous one still runs.
    """
    import torch

    t = torch.tensor(data, dtype=dtype)
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the OS maps (zero-filled) only when first touched.

    ``torch.zeros`` writes every byte at once: a 4 GiB KV cache took seconds to start and was
    resident whether used or not. An anonymous memory map is zero by definition and becomes
    resident page by page as the cache fills; it is page-aligned, so cache-line aligned too.
    The tensor keeps the map alive.
    """
    import math
    import mmap

    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def process_age_s() -> float | None:
    """Seconds since this process started (from Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (after the parenthesised command name) is the start time in clock ticks.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def release_freed_memory() -> None:
    """Hand memory freed while quantizing back to the OS (glibc only; a no-op elsewhere).

    Quantizing frees thousands of mid-sized temporaries that glibc keeps in its heap: without
    this the process stays ~150 MB larger after loading the 135M model than its live tensors.
    """
    trim = malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (give the heap's free pages back to the OS), or None where the
    C library has none (not Linux, or musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
