"""The Triton fp8 matmul (tokenmill/quant/fp8_gemm.py) against the product it replaces, and
the tuning that picks it per GPU and shape. Without a GPU the kernel runs in Triton's
interpreter on CPU tensors, with an fp32 output (the interpreter gets bf16 wrong); on CUDA it
is checked against ``torch._scaled_mm`` in bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.quant import fp8  # noqa: E402
from tokenmill.quant import fp8_gemm as fg  # noqa: E402
from tokenmill.quant.fp8 import FP8_MAX, Fp8Linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OUT = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale_a = torch.rand(m, 1, generator=gen) / 100 + 1e-3
    scale_b = torch.rand(1, n, generator=gen) / 100 + 1e-3
    bias = torch.randn(n, generator=gen)
    return tuple(t.to(DEVICE) for t in (a, b, scale_a, scale_b, bias))


@pytest.mark.parametrize("m,n,k,tile", [
    (1, 48, 96, fg.GemmTile(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=2)),
    (70, 48, 80, fg.GemmTile(block_m=32, block_n=16, block_k=32, group_m=2)),  # K masked
    (33, 40, 64, fg.GemmTile(block_m=16, block_n=32, block_k=64, group_m=3)),  # N masked
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_matches_the_scaled_product(m: int, n: int, k: int, tile: fg.GemmTile,
                                              with_bias: bool) -> None:
    a, b, scale_a, scale_b, bias = _operands(m, n, k, m + n + k)
    bias = bias if with_bias else None
    got = fg.scaled_mm(a, scale_a, b, scale_b, bias, OUT, tile)
    want = (a.float() @ b.float().T) * scale_a * scale_b + (0 if bias is None else bias)
    assert got.dtype == OUT and got.shape == (m, n)
    tol = 1e-5 if OUT == torch.float32 else 1e-2
    assert ((got.float() - want).norm() / want.norm()).item() <= tol
    if DEVICE.type == "cuda":
        ref = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=OUT,
                               bias=None if bias is None else bias.to(OUT))
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() <= 1e-2


def test_scaled_mm_checks_its_operands() -> None:
    a, b, scale_a, scale_b, _ = _operands(4, 32, 64, 0)
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[N, K\]"):
        fg.scaled_mm(a, scale_a, b[:, :32], scale_b, None, OUT, fg.GemmTile())
    assert fg.scaled_mm(a[:0], scale_a[:0], b, scale_b, None, OUT, fg.GemmTile()).shape == (0, 32)


def test_rules_by_rows_and_shape() -> None:
    data = {"fp8_gemm": [
        {"max_m": 64, "n": 4096, "k": 14336, "block_m": 64, "block_n": 32},
        {"max_m": 64, "impl": "cublas"},
        {"max_m": 512, "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}]}
    tuning = fg.parse_tuning(data, "t")
    assert tuning.tile_for(16, 4096, 14336) == fg.GemmTile(block_m=64, block_n=32)
    assert tuning.tile_for(16, 6144, 4096) is None  # cuBLAS, by the second rule
    assert tuning.tile_for(256, 6144, 4096) == fg.GemmTile(128, 64, 128, 8, 8, 3)
    assert tuning.tile_for(513, 6144, 4096) is None  # no rule: cuBLAS
    assert fg.GemmTuning().tile_for(1, 16, 16) is None
    # Asked again (kept per shape): the same picks, and another tuning keeps its own.
    assert tuning.tile_for(16, 4096, 14336) == fg.GemmTile(block_m=64, block_n=32)
    assert tuning.tile_for(16, 6144, 4096) is None
    assert fg.GemmTuning().tile_for(16, 4096, 14336) is None
    assert tuning == fg.parse_tuning(data, "t")  # what it has picked is not compared


@pytest.mark.parametrize("data,message", [
    ({}, "non-empty list 'fp8_gemm'"),
    ({"fp8_gemm": [{"max_m": 0}]}, r"fp8_gemm\[0\]: max_m must be null or a positive integer"),
    ({"fp8_gemm": [{"block_m": 48}]}, r"fp8_gemm\[0\]: block_m must be a power of two"),
    ({"fp8_gemm": [{}, {"impl": "cutlass"}]}, r"fp8_gemm\[1\]: impl must be one of"),
    ({"fp8_gemm": [{"num_stages": 0}]}, r"fp8_gemm\[0\]: num_stages must be 1..8"),
])
def test_bad_files_name_the_entry(tmp_path: Path, data: object, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as e:
        fg.load_tuning(path)
    assert str(path) in str(e.value)


def test_the_environment_names_the_tuning_file(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"fp8_gemm": [{"max_m": 8, "block_m": 16}]}))
    fg.tuning_for_device.cache_clear()
    try:
        assert fg.tuning_for_device("Some GPU").rules == ()  # no file for it: cuBLAS
        fg.tuning_for_device.cache_clear()
        monkeypatch.setenv(fg.ENV_FILE, str(path))
        assert fg.tuning_for_device("Some GPU").tile_for(8, 16, 16) == fg.GemmTile(block_m=16)
        fg.tuning_for_device.cache_clear()
        monkeypatch.setenv(fg.ENV_FILE, str(tmp_path / "missing.json"))
        with pytest.raises(ValueError, match=r"\$TOKENMILL_FP8_GEMM_TUNING=.*: no such file"):
            fg.tuning_for_device("Some GPU")
    finally:
        fg.tuning_for_device.cache_clear()


def test_fp8_linear_runs_the_tuned_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the tuning gives a tile, Fp8Linear's product is the Triton kernel's (asked with
    the activations' rows and the weight's shape), and equals the scaled product."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen)
    layer = Fp8Linear(*fp8.quantize_fp8(weight), torch.randn(48, generator=gen)).to(DEVICE)
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    asked: list[tuple[int, int, int]] = []
    tile = fg.GemmTile(block_m=16, block_n=16, block_k=32, num_warps=2, num_stages=2)

    def gemm_tile(a: torch.Tensor, n: int) -> fg.GemmTile:
        asked.append((a.shape[0], n, a.shape[1]))
        return tile

    monkeypatch.setattr(fp8, "gemm_tile", gemm_tile)
    monkeypatch.setattr(fp8, "KERNEL_DTYPE", OUT)
    got = layer(x)
    assert asked == [(5, 48, 64)]
    q = fp8.quantize_activation(x)
    want = ((q.values.float() @ layer.weight.float().T) * q.scale * layer.weight_scale
            + layer.bias)
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2

def test_off_cuda_the_tuning_is_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tuning(index: int) -> None:
        raise AssertionError("read a GPU's tuning for a CPU tensor")

    monkeypatch.setattr(fp8, "_gemm_tuning", no_tuning)
    assert fp8.gemm_tile(torch.zeros(2, 16, dtype=torch.float8_e4m3fn), 16) is None


@pytest.mark.slow
@pytest.mark.skipif(not fp8.fp8_supported(torch.device("cpu")),
                    reason="the script's CPU run needs a CPU _scaled_mm with per-row scales "
                           "(torch 2.13 has one; a GPU image's 2.11 does not)")
def test_sweep_script_writes_a_tuning_file_the_engine_reads(tmp_path: Path) -> None:
    """benchmarks/gpu/fp8_gemm_bw.py in the interpreter (no timings there, so cuBLAS is kept
    everywhere): every tile computed and compared with cuBLAS, a rule per class and shape."""
    import os
    import subprocess
    import sys

    root = Path(__file__).parents[2]
    tuning, result = tmp_path / "t.json", tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks/gpu/fp8_gemm_bw.py"),
                           "--write-tuning", str(tuning), "--result-file", str(result)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root),
                               # the toy sizes in the interpreter, on a GPU machine too
                               "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = fg.load_tuning(tuning)
    assert [(r.max_m, r.n, r.k, r.tile) for r in loaded.rules] == [(16, 48, 64, None),
                                                                    (None, 48, 64, None)]
    rows = json.loads(result.read_text())["results"]
    assert all(t["rel_err_vs_cublas"] < 1e-5 for r in rows for t in r["triton"])
