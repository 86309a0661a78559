"""tokenmill.engine.device: the server's view of the device (free memory, CUDA or not)
without reaching into the runner."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.device import CPU_DEFAULT_KV_BYTES_CAP, EngineDevice
from tokenmill.runner.kv_memory import CPU_DEFAULT_KV_BYTES_CAP as RUNNER_CAP
from tokenmill.runner.platform import get_platform


def test_the_cpu_as_the_runner_sees_it() -> None:
    device = EngineDevice("cpu")
    assert device.is_cuda is False
    free = device.available_memory()
    # Free memory moves a little between two reads; the two readers agree within 5%.
    assert free == pytest.approx(get_platform("cpu").available_memory(), rel=0.05)
    assert free > 0 and CPU_DEFAULT_KV_BYTES_CAP == RUNNER_CAP


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_gpu_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'cuda' was asked for"):
        EngineDevice("cuda")
