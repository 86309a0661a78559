"""tokenmill's C++ extension for the CPU: where its sources live and how it is built and loaded.

One extension holds every hand-written CPU kernel: the op program interpreter
(``op_program.cpp``, its programs lowered from the module tree by
``tokenmill.runner.cpu_program``), the weight-only int4 / int8
matmuls (``quant_gemm.h``, ``int_dot.h``, called by ``tokenmill.quant.linear``) and the grammar
bitmask (``token_bitmask.h``), all of them parallel on the extension's own worker threads
(``thread_pool.h``). It is compiled once with ``torch.utils.cpp_extension.load`` (about a
minute; ``scripts/install.sh`` does it at install time) and cached on disk.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import time
import weakref
from pathlib import Path
from types import ModuleType

from tokenmill import envs

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent
_SOURCE_SUFFIXES = (".cpp", ".h")


# -fno-trapping-math lets GCC vectorize loops with clamps and float-to-int conversions
# (exp_poly: SiLU, softmax; the activation quantizer): no result changes, only which FP
# exceptions may be raised.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]


def cpu_flags() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo's flags line), or the machine name
    elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine()


# A build takes about a minute: a lock older than this was left by a killed build.
STALE_LOCK_S = 600


def clear_stale_build_lock(name: str) -> None:
    """Before ``cpp_extension.load(name=name, ...)``: torch waits forever on the lock file of
    a build of ``name`` that was killed half-way; remove one older than any build takes."""
    from torch.utils import cpp_extension

    build_dir = getattr(cpp_extension, "_get_build_directory", None)  # private: may go away
    if build_dir is not None:
        _remove_stale_lock(os.path.join(build_dir(name, False), "lock"))


def _remove_stale_lock(path: str) -> None:
    """Remove the lock file ``path`` if it is older than any build takes."""
    try:
        age = time.time() - os.path.getmtime(path)
    except OSError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing %s, left %.0f s ago by a build that did not finish", path, age)
        with contextlib.suppress(OSError):
            os.remove(path)


# The workers' spin time asked for by the engine (--kernel-spin-us), applied when the extension
# loads; None: the pool's own default (200 us, or TOKENMILL_SPIN_US).
_kernel_spin_us: int | None = None
# The pool's defaults where the environment says nothing (see thread_pool.h).
DEFAULT_SPIN_US = 200
DEFAULT_POOL_CHUNKS = 2


def set_kernel_spin_us(us: int | None) -> None:
    """How long the extension's workers spin for the next parallel call before they sleep
    (0: never spin; None: leave the default). Applies at once if the extension is loaded,
    else when it loads."""
    global _kernel_spin_us
    if us is None:
        return
    if us < 0:
        raise ValueError(f"kernel_spin_us must be >= 0, got {us}")
    _kernel_spin_us = us
    ext = extension_if_loaded()
    if ext is not None:
        ext.set_pool_spin_us(us)


_SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: Path = _SYSFS_CACHES) -> int | None:
    """The size of the CPU's last-level data cache as Linux reports it for CPU 0 (one
    instance: what the cores sharing it can hold), or None where it does not."""
    best: tuple[int, int] | None = None
    for index in caches.glob("index*"):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        num = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        if best is None or level > best[0]:
            best = (level, num)
    return best[1] if best else None


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("AuthenticAMD", "GenuineIntel"), or ""
    where it does not say."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# Where the cache size is unknown, a common last-level cache (a Zen or Xeon slice).
_DEFAULT_LLC_BYTES = 32 << 20
# The CPUs on which a non-temporal fetch of the weights was measured to help: AMD's (a Zen 5,
# +10% a batch-1 decode step). On an Intel Xeon (2 cores with AMX, 2026-11-28) the same switch
# made the step 2.3-2.6x slower (benchmarks/results/stream-weights-ab-xeon-amx-cpu.json):
# prefetchnta there reads the weights at ~7 GB/s where prefetcht0 streams them at ~22, whatever
# the model's size against the cache, so elsewhere the weights are fetched normally.
_STREAMING_VENDORS = ("AuthenticAMD",)
# Bytes of weights of this process's models (note_model_weights), and whether the kernels
# fetch them non-temporally: applied when the extension loads, or at once if it has.
_model_weight_bytes = 0
_stream_weights = False


def note_model_weights(nbytes: int, stream: bool | None = None, owner: object = None) -> bool:
    """A model of ``nbytes`` of weights will run on the CPU kernels in this process. Once the
    process's models add up to more than the last-level cache, every step reads them from
    memory anyway: the kernels then fetch weights non-temporally (on AMD's CPUs, where that
    was measured to help; see _STREAMING_VENDORS). ``stream`` True / False
    forces it on / off (the runner's ``TOKENMILL_STREAM_WEIGHTS``). With an ``owner`` (the
    model), its bytes leave the sum when it is garbage-collected (a model unloaded from a
    multi-model server), and the choice is made again. Returns whether they now stream."""
    global _model_weight_bytes
    nbytes = max(0, int(nbytes))
    _model_weight_bytes += nbytes
    if owner is not None:
        weakref.finalize(owner, _forget_model_weights, nbytes, stream)
    return _decide_streaming(stream)


def _forget_model_weights(nbytes: int, stream: bool | None) -> None:
    global _model_weight_bytes
    _model_weight_bytes = max(0, _model_weight_bytes - nbytes)
    _decide_streaming(stream)


def _decide_streaming(stream: bool | None) -> bool:
    """Stream when told to, else on the CPUs where it helps (_STREAMING_VENDORS) when the
    process's models outgrow the last-level cache; tell the extension if it is loaded
    (load_extension applies it otherwise)."""
    global _stream_weights
    if stream is None:
        stream = (cpu_vendor() in _STREAMING_VENDORS
                  and _model_weight_bytes > (last_level_cache_bytes() or _DEFAULT_LLC_BYTES))
    _stream_weights = stream
    ext = extension_if_loaded()
    if ext is not None:
        ext.set_stream_weights(stream)
    return stream


@functools.cache
def load_extension() -> ModuleType:
    """Compile (first time, ~1 minute) or load the cached C++ extension."""
    module = _build_or_load()
    # The pool's settings from the environment, read here (tokenmill.envs) and not by the C++:
    # before any kernel call starts the pool.
    module.configure_pool(envs.TOKENMILL_THREAD_POOL,
                          DEFAULT_SPIN_US if envs.TOKENMILL_SPIN_US is None
                          else envs.TOKENMILL_SPIN_US,
                          envs.TOKENMILL_POOL_CHUNKS or DEFAULT_POOL_CHUNKS)
    if _kernel_spin_us is not None:
        module.set_pool_spin_us(_kernel_spin_us)
    # The output head's AMX path gives the vector path's bits; TOKENMILL_AMX=0 turns it off
    # (a platform whose tile state is suspect, or an A/B run).
    if not envs.TOKENMILL_AMX:
        module.set_amx(False)
    module.set_stream_weights(_stream_weights)
    return module


def _build_or_load() -> ModuleType:
    import torch  # noqa: F401  (cpp_extension needs torch imported)
    from torch.utils import cpp_extension

    # torch rebuilds when the .cpp changes but not when a header does, and its cache is keyed
    # by name alone: the name carries a hash of every source in csrc (an edited header is a
    # new extension), of the checkout's path (two checkouts do not rebuild each other's copy)
    # and of the CPU's features (-march=native code from another machine could crash here).
    digest = hashlib.sha256(str(_CSRC).encode() + cpu_flags().encode()
                            + " ".join(_CFLAGS).encode())
    for path in sorted(p for p in _CSRC.iterdir() if p.suffix in _SOURCE_SUFFIXES):
        digest.update(path.name.encode() + path.read_bytes())
    name = f"tokenmill_op_program_{digest.hexdigest()[:12]}"
    clear_stale_build_lock(name)
    return cpp_extension.load(
        name=name,
        sources=[str(_CSRC / "op_program.cpp")],
        extra_include_paths=[str(_CSRC)],
        # Built on the machine that runs it, so tuning for its CPU is safe. OpenMP makes
        # at::parallel_for parallel inside the extension too (the kernels' threads with
        # TOKENMILL_THREAD_POOL=0, see thread_pool.h).
        extra_cflags=_CFLAGS,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def extension_if_loaded() -> ModuleType | None:
    """The extension if this process has loaded it already; never starts a build."""
    return load_extension() if load_extension.cache_info().currsize else None


@functools.cache
def extension_or_none() -> ModuleType | None:
    """The extension, built if need be; None (with one warning) where it cannot be built, so
    that callers fall back to PyTorch's own kernels."""
    try:
        return load_extension()
    except Exception as e:  # no compiler, no ninja, a broken toolchain: never fatal
        logger.warning("tokenmill's C++ extension failed to build or load, using PyTorch's "
                       "kernels instead: %s", e)
        return None
