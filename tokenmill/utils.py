"""Small helpers every layer may use. They import nothing from tokenmill, and torch only when
called (the scheduler and the block pool stay free of torch)."""

from __future__ import annotations

import functools
import gc
import importlib
import itertools
import os
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def env_switch(name: str) -> bool | None:
    """The on/off switch ``$name``: 1/true/on/yes or 0/false/off/no (any case); None where it
    is unset, empty or "auto"; anything else a ValueError naming the variable."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def env_flag(name: str, default: bool) -> bool:
    """``env_switch(name)``, ``default`` where it is not set."""
    value = env_switch(name)
    return default if value is None else value


def env_count(name: str, unit: str, default: int) -> int:
    """The whole number >= 0 that ``$name`` gives (of ``unit``, which the error names),
    ``default`` where it is unset or empty; anything else a ValueError naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of {unit}, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now into the garbage collector's permanent
    generation; returns how many. Call it where a long-running process has finished starting
    (the model, the tokenizer and the app loaded): none of that is ever garbage, yet without
    this each full collection walks all of it, and it runs in the middle of whatever step
    allocated last: 100-108 ms at ~227,000 objects at batch 256 on the 2-core EPYC, 8 ms frozen
    (benchmarks/gc_pauses.py). vLLM and SGLang freeze after loading too.
    ``TOKENMILL_GC_FREEZE=0`` turns it off (returns 0)."""
    if not env_flag("TOKENMILL_GC_FREEZE", True):
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
    import os

    try:
        with open("/proc/self/stat") as f:
            # Field 22 (after the parenthesised command name) is the start time in clock ticks.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


# Environment variables that choose how OpenMP's idle threads wait; a user who set any of them
# keeps their choice.
THREAD_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# Set beside OMP_WAIT_POLICY when default_thread_policy chose it (not the user): see
# foreign_environ.
_DEFAULTED_MARK = "TOKENMILL_DEFAULTED_OMP_WAIT_POLICY"


def default_thread_policy() -> None:
    """Let OpenMP's idle threads sleep instead of spin, unless the user chose otherwise.

    libgomp's default has every thread spin at each barrier before it sleeps. On a machine whose
    cores are shared (a neighbour process, another engine), a spinning thread burns the time
    slice the thread it waits for needs, and a decode step of a few hundred barriers slows down
    by an order of magnitude; sleeping threads slow down only by the share of cores lost
    (`tokenmill bench contention` measures both). libgomp reads this once, when it is loaded,
    so it must run before torch is imported; if torch is already loaded it changes nothing.
    """
    import os
    import sys

    if "torch" in sys.modules or any(v in os.environ for v in THREAD_POLICY_VARS):
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ[_DEFAULTED_MARK] = "1"


def foreign_environ() -> dict[str, str]:
    """This process's environment for a child that is not tokenmill (a benchmark's peer): without
    the OpenMP wait policy that :func:`default_thread_policy` chose, so the child runs with its
    own defaults, as its users run it. A policy the user set stays. (llama.cpp's OpenMP build
    under the passive policy decoded ~3x slower on a quiet 2-core machine; tokenmill's own
    children set the policy again when they import tokenmill.)"""
    import os

    env = dict(os.environ)
    if env.pop(_DEFAULTED_MARK, None) is not None:
        env.pop("OMP_WAIT_POLICY", None)
    return env
