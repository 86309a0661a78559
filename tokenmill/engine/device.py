"""The device an engine runs on, as the layers above the engine see it.

The server splits one KV-cache budget among its models before any of them loads: it needs the
memory free on the device and the CPU's default cap, which the runner's platform knows. This is
its door to them (the server talks to the engine only).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.runner.kv_memory import CPU_DEFAULT_KV_BYTES_CAP
from tokenmill.runner.platform import get_platform

__all__ = ["CPU_DEFAULT_KV_BYTES_CAP", "DeviceMemory", "device_memory"]


@dataclass(frozen=True)
class DeviceMemory:
    """Memory of the device an engine would run on, before anything loads."""

    # Bytes free now: host memory available on the CPU, free device memory on CUDA.
    free_bytes: int
    is_cuda: bool


def device_memory(device: str = "auto") -> DeviceMemory:
    """The memory of ``device`` ("auto", "cpu", "cuda", "cuda:N"), as the engine would pick it."""
    platform = get_platform(device)
    return DeviceMemory(platform.available_memory(), platform.is_cuda)
