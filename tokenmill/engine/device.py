"""The device an engine runs on, as the layers above the engine see it.

The server splits one KV-cache budget among its models before any of them loads: it needs the
memory free on the device and the CPU's default cap, which the runner's platform knows. This is
its door to them (the server talks to the engine only, never to the runner).
"""

from __future__ import annotations

from tokenmill.runner.kv_memory import CPU_DEFAULT_KV_BYTES_CAP
from tokenmill.runner.platform import get_platform

__all__ = ["CPU_DEFAULT_KV_BYTES_CAP", "EngineDevice"]


class EngineDevice:
    """The device an engine configured with ``device`` ("auto", "cpu", "cuda", "cuda:N") runs
    on; ValueError for CUDA where there is none."""

    def __init__(self, device: str = "auto") -> None:
        self._platform = get_platform(device)

    @property
    def is_cuda(self) -> bool:
        """Whether it is a CUDA device."""
        return self._platform.is_cuda

    def available_memory(self) -> int:
        """Bytes free now: available host memory on the CPU, free device memory on CUDA."""
        return self._platform.available_memory()
