"""Device specifics behind one small object: dtype choice, memory, threads, attention backend."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend, TorchAttentionBackend

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Platform:
    """The device the model runs on and the choices that depend on it."""

    device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        """The compute dtype for a configured name; "auto" picks fast-and-exact-enough.

        On the CPU that is float32: at batch 1 bf16 matmuls are barely faster here and
        bf16 logits would drift from the reference. On CUDA it is bf16 where supported.
        """
        if dtype != "auto":
            return _DTYPES[dtype]
        if self.is_cuda:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32

    def available_memory(self) -> int:
        """Bytes of device memory free now."""
        if self.is_cuda:
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free)
        return _host_available_memory()

    def attention_backend(self) -> AttentionBackend:
        """The attention implementation for this device."""
        return TorchAttentionBackend()

    def set_num_threads(self, num_threads: int | None) -> None:
        """Use every core we may run on unless told otherwise (CPU only)."""
        if self.is_cuda:
            return
        if num_threads is None:
            try:
                num_threads = len(os.sched_getaffinity(0))
            except AttributeError:  # not on Linux
                num_threads = os.cpu_count() or 1
        torch.set_num_threads(num_threads)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def _host_available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def get_platform(device: str = "auto") -> Platform:
    """The Platform for a configured device name ("auto", "cpu", "cuda", "cuda:N")."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
    return Platform(torch.device(device))
