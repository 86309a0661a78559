"""Programmatic dependent launch (tokenmill/kernels/triton/pdl.py): asked for by TOKENMILL_PDL, given only to
GPUs of compute capability 9.0 or later, and to CUDA tensors. The kernels' side (each waits,
then signals, before anything else it does) is checked on compiled code by the slow compile
test, and on a GPU by tests/gpu/test_cuda_engine.py::test_pdl_keeps_the_tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels.triton import pdl  # noqa: E402

CUDA0 = torch.device("cuda", 0)
ON = {"PDL": True, "launch_pdl": True}


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test reads the variable afresh, and leaves no answer cached behind it."""
    monkeypatch.delenv(pdl.ENV, raising=False)
    pdl.reset()
    yield
    pdl.reset()


def capability(monkeypatch: pytest.MonkeyPatch, cc: tuple[int, int]) -> list[int]:
    """Pretend every CUDA device has compute capability ``cc``; the devices asked, in order."""
    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda index=None: asked.append(index) or cc)
    return asked


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    capability(monkeypatch, (9, 0))
    assert pdl.launch_options(CUDA0) == {}
    for off in ("0", "false", "OFF", " no ", "auto"):
        monkeypatch.setenv(pdl.ENV, off)
        pdl.reset()
        assert pdl.launch_options(CUDA0) == {}


def test_on_for_hopper_and_later_once_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = capability(monkeypatch, (9, 0))
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.launch_options(CUDA0) == ON
    assert pdl.launch_options(CUDA0) == ON
    assert pdl.launch_options(torch.device("cuda", 1)) == ON
    assert asked == [0, 1]  # read once a device: kernels launch hundreds of times a step
    # The answer is a copy: a caller that changes it changes nothing for the next.
    pdl.launch_options(CUDA0).clear()
    assert pdl.launch_options(CUDA0) == ON


def test_never_on_older_gpus_or_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pdl.ENV, "true")
    capability(monkeypatch, (8, 9))  # Ada: no griddepcontrol
    assert pdl.launch_options(CUDA0) == {}
    assert pdl.launch_options(torch.device("cpu")) == {}  # Triton's interpreter


def test_names_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    capability(monkeypatch, (9, 0))
    monkeypatch.setenv(pdl.ENV, "maybe")
    with pytest.raises(ValueError, match=r"TOKENMILL_PDL must be 0 or 1, got 'maybe'"):
        pdl.launch_options(CUDA0)
    monkeypatch.setenv(pdl.ENV, "yes")  # a good value after it is read as usual
    assert pdl.launch_options(CUDA0) == ON


def test_reset_reads_the_variable_again(monkeypatch: pytest.MonkeyPatch) -> None:
    capability(monkeypatch, (10, 0))
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.launch_options(CUDA0) == ON
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.launch_options(CUDA0) == ON  # cached
    pdl.reset()
    assert pdl.launch_options(CUDA0) == {}


def test_kernels_run_as_before_without_it() -> None:
    """Every kernel takes the flag with a default of off, so a launch that does not pass it
    (tests, benchmarks, the interpreter) runs the kernel as before: here one of the layers'
    kernels, against its PyTorch arithmetic."""
    from tokenmill.kernels.triton import fused_ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    w = torch.rand(64, dtype=torch.float16, device=device) + 0.5
    got, _ = fused_ops.rms_norm(x, w, 1e-6)
    want = torch.nn.functional.rms_norm(x.float(), (64,), None, 1e-6).to(x.dtype) * w
    assert torch.allclose(got.float(), want.float(), atol=2e-3)


def test_a_matmul_program_prefetches_its_share_of_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENMILL_PDL_PREFETCH_KB (64 by default) a program, spread over its rows of the weight
    in 128-byte lines, a power of two of them, never past the row; none without PDL."""
    capability(monkeypatch, (9, 0))
    assert pdl.prefetch_lines(CUDA0, 32, 8192) == 0  # PDL off
    monkeypatch.setenv(pdl.ENV, "1")
    pdl.reset()
    # 64 KB over 32 rows: 2 KB a row, 16 lines; over 128 rows, 4; over 16, 32.
    assert [pdl.prefetch_lines(CUDA0, rows, 8192) for rows in (32, 128, 16)] == [16, 4, 32]
    assert pdl.prefetch_lines(CUDA0, 16, 1024) == 8  # a short row: all of it
    assert pdl.prefetch_lines(CUDA0, 24, 8192) == 16  # 2,730 B a row: 21 lines, down to 16
    assert pdl.prefetch_lines(torch.device("cpu"), 32, 8192) == 0
    monkeypatch.setenv(pdl.PREFETCH_ENV, "1")
    pdl.reset()
    assert pdl.prefetch_lines(CUDA0, 16, 8192) == 0  # 64 B a row: less than a line
    assert pdl.prefetch_lines(CUDA0, 8, 8192) == 1
    monkeypatch.setenv(pdl.PREFETCH_ENV, "0")
    pdl.reset()
    assert pdl.prefetch_lines(CUDA0, 1, 8192) == 0
    assert pdl.launch_options(CUDA0) == ON  # PDL itself stays on


@pytest.mark.parametrize("raw", ["-1", "lots", "1.5"])
def test_names_a_bad_prefetch_size(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    capability(monkeypatch, (9, 0))
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setenv(pdl.PREFETCH_ENV, raw)
    with pytest.raises(ValueError, match="TOKENMILL_PDL_PREFETCH_KB must be"):
        pdl.launch_options(CUDA0)
    monkeypatch.setenv(pdl.PREFETCH_ENV, "16")  # a good size after it is read as usual
    assert pdl.launch_options(CUDA0) == ON
    assert pdl.prefetch_lines(CUDA0, 32, 8192) == 4  # 16 KB over 32 rows: 512 B, 4 lines
