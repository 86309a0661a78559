"""The fused fp8 activation quantization (tokenmill/kernels/triton/fp8.py) against the PyTorch
ops Fp8Linear runs without it. Without a GPU the kernel runs in Triton's interpreter on CPU
tensors: fp32 and fp16 inputs (the interpreter gets bf16 wrong, so bf16 is checked on CUDA),
and an fp32 output in place of e4m3, since the interpreter's own fp8 cast rounds wrongly at
powers of two (7.87 -> 4.0); on CUDA the output is e4m3, cast by the hardware."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels.triton import fp8 as fp8_kernels  # noqa: E402
from tokenmill.quant.fp8 import FP8_MAX  # noqa: E402
from tokenmill.quant.packing import scale_rows_absmax  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


# What the kernel writes: e4m3 on CUDA, the clamped scaled values before the cast elsewhere.
OUT = torch.float8_e4m3fn if DEVICE.type == "cuda" else torch.float32


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scaled, scale = scale_rows_absmax(x, FP8_MAX)
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(OUT), scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
# Rows up to 16,384 columns are read once, longer ones twice (the absmax, then the values).
@pytest.mark.parametrize("shape", [(1, 64), (5, 1000), (3, 4096 + 17), (3, 16384 + 17)])
def test_quantize_rows_matches_the_pytorch_ops(dtype: torch.dtype, shape: tuple[int, int]
                                               ) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen, device=DEVICE) * 3).to(dtype)
    x[0, 7] = 40.0  # one outlier sets its row's scale
    if shape[0] > 2:
        x[2] = 0.0  # an all-zero row: scale 1, all zeros
    q, scale = fp8_kernels.quantize_rows_fp8(x, FP8_MAX, OUT)
    want_q, want_scale = _reference(x)
    assert q.dtype == OUT and scale.shape == (shape[0], 1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(_bits(q), _bits(want_q))
    assert q.float().abs().max() <= FP8_MAX and not torch.isnan(q.float()).any()


def test_rows_of_a_strided_view() -> None:
    x = torch.randn(4, 96, device=DEVICE)[:, :64]  # row stride 96, last dim contiguous
    q, scale = fp8_kernels.quantize_rows_fp8(x, FP8_MAX, OUT)
    want_q, want_scale = _reference(x)
    assert torch.equal(_bits(q), _bits(want_q))
    assert torch.equal(scale, want_scale)


def test_rejects_a_non_contiguous_last_dim() -> None:
    with pytest.raises(ValueError, match="contiguous last"):
        fp8_kernels.quantize_rows_fp8(torch.randn(8, 4, device=DEVICE).t(), FP8_MAX)


@pytest.mark.slow
def test_row_quant_bench_script_compares_both_launches(tmp_path) -> None:
    """benchmarks/gpu/row_quant_bw.py, in the interpreter without a GPU (nothing timed
    there): both launches of both kernels ran and wrote the same bytes."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    result = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks/gpu/row_quant_bw.py"),
                           "--result-file", str(result)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(root),
                               # the toy sizes in the interpreter, on a GPU machine too
                               "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(result.read_text())["results"]
    assert len(rows) == 4 and all(r["same_bytes"] for r in rows)
    assert {tuple(r["two-pass_launch"]) for r in rows} == {(2048, 4, False)}
