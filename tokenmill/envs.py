"""Every environment variable tokenmill reads, read here and only here (vLLM's ``envs.py``).

Each variable is an attribute of this module, read from the environment each time it is asked
for (``tokenmill.envs.TOKENMILL_GC_FREEZE``), never when a module is imported, so a test or a
benchmark may set one while the process runs. :data:`VARIABLES` says what each one does and
its default; docs/reference/environment.md is generated from it. A bad value is a ValueError
that names the variable. Variables that a library reads itself (``HF_HOME``, ``HF_TOKEN`` by
huggingface_hub, ``TRITON_INTERPRET`` by Triton) are left to it.

Importing tokenmill changes nothing in ``os.environ``: the one variable tokenmill sets for
itself (OpenMP's wait policy, which must be in place before torch loads) is set by the
``tokenmill`` command when it starts (:func:`default_thread_policy`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the attributes' types, for type checkers (read by __getattr__)
    TOKENMILL_API_KEY: str | None
    TOKENMILL_ADMIN_KEY: str | None
    TOKENMILL_GC_FREEZE: bool
    TOKENMILL_STREAM_WEIGHTS: bool | None
    TOKENMILL_AMX: bool
    TOKENMILL_CPU_INT_KERNELS: bool
    TOKENMILL_INT_ACTIVATIONS: bool
    TOKENMILL_INT4_ACT_BITS: int
    TOKENMILL_INT4_DECODE_ACT_BITS: int
    TOKENMILL_FUSED_DECODE: bool | None
    TOKENMILL_FUSED_PREFILL: bool | None
    TOKENMILL_SPIN_US: int | None
    TOKENMILL_THREAD_POOL: bool
    TOKENMILL_POOL_CHUNKS: int | None
    TOKENMILL_DECODE_TUNING: str | None
    TOKENMILL_GEMM_TUNING: str | None
    TOKENMILL_L2_PREFETCH: int
    TOKENMILL_PDL: bool
    TOKENMILL_PDL_PREFETCH_KB: int
    OMP_WAIT_POLICY: str | None
    GOMP_SPINCOUNT: str | None
    KMP_BLOCKTIME: str | None
    XDG_CACHE_HOME: str


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def switch(name: str) -> bool | None:
    """The on/off switch ``$name``: 1/true/on/yes or 0/false/off/no (any case); None where it
    is unset, empty or "auto"; anything else a ValueError naming the variable."""
    value = _raw(name).lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def flag(name: str, default: bool) -> bool:
    """``switch(name)``, ``default`` where it is not set."""
    value = switch(name)
    return default if value is None else value


def count(name: str, unit: str, default: int) -> int:
    """The whole number >= 0 that ``$name`` gives (of ``unit``, which the error names),
    ``default`` where it is unset or empty; anything else a ValueError naming the variable."""
    raw = _raw(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of {unit}, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _text(name: str) -> str | None:
    """``$name``, None where it is unset or empty."""
    return _raw(name) or None


def _bits(name: str, default: int) -> int:
    bits = count(name, "bits", default)
    if bits not in (8, 16):
        raise ValueError(f"{name} must be 8 or 16, got {bits}")
    return bits


def _optional_count(name: str, unit: str) -> int | None:
    return count(name, unit, 0) if _raw(name) else None


def _cache_home() -> str:
    return _raw("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, its default as the docs say it, what it does, how
    it is read (``read``, called on each access), and who reads it where that is not
    tokenmill's Python (the C++ kernels, OpenMP)."""

    name: str
    default: str
    doc: str
    read: Callable[[], Any]
    read_by: str = ""


_VARS = (
    EnvVar("TOKENMILL_API_KEY", "unset",
           "The default of `--api-key` (serve, chat --url, models): the key clients send as "
           "`Authorization: Bearer`.", lambda: _text("TOKENMILL_API_KEY")),
    EnvVar("TOKENMILL_ADMIN_KEY", "unset",
           "The default of `--admin-key` (serve, models, monitor): the key of the admin API.",
           lambda: _text("TOKENMILL_ADMIN_KEY")),
    EnvVar("TOKENMILL_GC_FREEZE", "1",
           "0: do not move the objects alive after start-up into the garbage collector's "
           "permanent generation (a full collection then walks them all, ~100 ms pauses).",
           lambda: flag("TOKENMILL_GC_FREEZE", True)),
    EnvVar("TOKENMILL_STREAM_WEIGHTS", "auto",
           "1 / 0: force the CPU kernels' non-temporal fetch of the weights on / off; auto: on "
           "AMD CPUs once the models outgrow the last-level cache.",
           lambda: switch("TOKENMILL_STREAM_WEIGHTS")),
    EnvVar("TOKENMILL_AMX", "1", "0: keep the int8 output head off the AMX tile unit.",
           lambda: flag("TOKENMILL_AMX", True)),
    EnvVar("TOKENMILL_CPU_INT_KERNELS", "1",
           "0: run quantized CPU layers on PyTorch's weight-only kernels instead of "
           "tokenmill's C++ int kernels (read when first needed).",
           lambda: flag("TOKENMILL_CPU_INT_KERNELS", True)),
    EnvVar("TOKENMILL_INT_ACTIVATIONS", "1",
           "0: tokenmill's int kernels widen activations to fp32 instead of quantizing them to "
           "integers (read when first needed).", lambda: flag("TOKENMILL_INT_ACTIVATIONS", True)),
    EnvVar("TOKENMILL_INT4_ACT_BITS", "16",
           "Activation bits (8 or 16) of int4 layers in steps with prompt tokens.",
           lambda: _bits("TOKENMILL_INT4_ACT_BITS", 16)),
    EnvVar("TOKENMILL_INT4_DECODE_ACT_BITS", "8",
           "Activation bits (8 or 16) of int4 layers in decode-only steps.",
           lambda: _bits("TOKENMILL_INT4_DECODE_ACT_BITS", 8)),
    EnvVar("TOKENMILL_FUSED_DECODE", "1",
           "0: keep decode steps off the fused C++ layer stack (run model.forward).",
           lambda: switch("TOKENMILL_FUSED_DECODE")),
    EnvVar("TOKENMILL_FUSED_PREFILL", "1",
           "0: keep steps with prompt tokens off the fused C++ layer stack.",
           lambda: switch("TOKENMILL_FUSED_PREFILL")),
    EnvVar("TOKENMILL_SPIN_US", "200",
           "Microseconds the C++ kernels' workers spin for the next call before they sleep "
           "(0: never); `--kernel-spin-us` overrides it.",
           lambda: _optional_count("TOKENMILL_SPIN_US", "microseconds"),
           read_by="tokenmill/kernels/cpu (load_extension), handed to the C++ thread pool before its first call"),
    EnvVar("TOKENMILL_THREAD_POOL", "1",
           "0: run the C++ kernels on OpenMP's threads (at::parallel_for) instead of their own "
           "pool.", lambda: _raw("TOKENMILL_THREAD_POOL") != "0",
           read_by="tokenmill/kernels/cpu (load_extension), handed to the C++ thread pool before its first call"),
    EnvVar("TOKENMILL_POOL_CHUNKS", "2",
           "Chunks per thread of each C++ kernel call.",
           lambda: _optional_count("TOKENMILL_POOL_CHUNKS", "chunks"),
           read_by="tokenmill/kernels/cpu (load_extension), handed to the C++ thread pool before its first call"),
    EnvVar("TOKENMILL_DECODE_TUNING", "the packaged file of the GPU",
           "A JSON file of GPU decode-attention tuning to use instead of the packaged one.",
           lambda: _text("TOKENMILL_DECODE_TUNING")),
    EnvVar("TOKENMILL_GEMM_TUNING", "the packaged file of the GPU",
           "A JSON file of Triton matmul tuning to use instead of the packaged one.",
           lambda: _text("TOKENMILL_GEMM_TUNING")),
    EnvVar("TOKENMILL_L2_PREFETCH", "0",
           "Experimental (CUDA graphs): MB of each next matmul's weight read into L2 ahead of "
           "it in small batches' decode graphs; 0: off.",
           lambda: count("TOKENMILL_L2_PREFETCH", "MB", 0)),
    EnvVar("TOKENMILL_PDL", "0",
           "Experimental: 1 launches the CUDA backend's Triton kernels with programmatic "
           "dependent launch on GPUs of compute capability 9.0 or later (Hopper).",
           lambda: flag("TOKENMILL_PDL", False)),
    EnvVar("TOKENMILL_PDL_PREFETCH_KB", "64",
           "With TOKENMILL_PDL: KB of weight each matmul program prefetches into L2 while the "
           "previous kernel ends.", lambda: count("TOKENMILL_PDL_PREFETCH_KB", "KB", 64)),
    EnvVar("OMP_WAIT_POLICY", "PASSIVE (set by the `tokenmill` command)",
           "How OpenMP's idle threads wait. The `tokenmill` command sets PASSIVE (sleep) "
           "unless this, GOMP_SPINCOUNT or KMP_BLOCKTIME is set; a library user sets it "
           "before Python starts.", lambda: _text("OMP_WAIT_POLICY"),
           read_by="OpenMP (libgomp) when torch loads"),
    EnvVar("GOMP_SPINCOUNT", "unset",
           "Set by you, it keeps the `tokenmill` command from choosing OMP_WAIT_POLICY.",
           lambda: _text("GOMP_SPINCOUNT"), read_by="OpenMP (libgomp) when torch loads"),
    EnvVar("KMP_BLOCKTIME", "unset",
           "Set by you, it keeps the `tokenmill` command from choosing OMP_WAIT_POLICY.",
           lambda: _text("KMP_BLOCKTIME"), read_by="Intel's OpenMP when torch loads"),
    EnvVar("XDG_CACHE_HOME", "~/.cache",
           "The folder under which tokenmill keeps its `tokenmill/` cache (the chat's "
           "history, the extracted embedding model).", _cache_home),
)
VARIABLES: Mapping[str, EnvVar] = {v.name: v for v in _VARS}


def __getattr__(name: str) -> Any:
    """``tokenmill.envs.NAME``: the variable's value now (see :data:`VARIABLES`)."""
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module 'tokenmill.envs' has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def tokenmill_settings() -> dict[str, str]:
    """The ``TOKENMILL_*`` variables set in this process, for a benchmark's command line."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TOKENMILL_")}


def child_environ(extra: Mapping[str, str] | None = None,
                  drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a child process, without ``drop``, with ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, **(extra or {})}


# OpenMP's variables that choose how idle threads wait; a user who set any of them keeps it.
THREAD_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# Set beside OMP_WAIT_POLICY when default_thread_policy chose it (not the user), so that
# foreign_environ can take it out again in this process's children too.
DEFAULTED_MARK = "TOKENMILL_DEFAULTED_OMP_WAIT_POLICY"


def default_thread_policy() -> None:
    """Let OpenMP's idle threads sleep instead of spin, unless the user chose otherwise. The
    ``tokenmill`` command calls it first thing; importing tokenmill does not.

    libgomp's default has every thread spin at each barrier before it sleeps. On a machine whose
    cores are shared (a neighbour process, another engine), a spinning thread burns the time
    slice the thread it waits for needs, and a decode step of a few hundred barriers slows down
    by an order of magnitude; sleeping threads slow down only by the share of cores lost
    (`tokenmill bench contention` measures both). libgomp reads this once, when it is loaded,
    so it must run before torch is imported; if torch is already loaded it changes nothing.
    """
    if "torch" in sys.modules or any(v in os.environ for v in THREAD_POLICY_VARS):
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ[DEFAULTED_MARK] = "1"


def foreign_environ() -> dict[str, str]:
    """This process's environment for a child that is not tokenmill (a benchmark's peer): without
    the OpenMP wait policy that :func:`default_thread_policy` chose, so the child runs with its
    own defaults, as its users run it. A policy the user set stays. (llama.cpp's OpenMP build
    under the passive policy decoded ~3x slower on a quiet 2-core machine; tokenmill's own
    children set the policy again when the `tokenmill` command starts.)"""
    env = dict(os.environ)
    if env.pop(DEFAULTED_MARK, None) is not None:
        env.pop("OMP_WAIT_POLICY", None)
    return env
