"""Llama-3.1-8B's linear layers alone: cuBLAS against the Triton matmul of
``tokenmill/kernels/triton/gemm.py`` at several tile shapes, by batch rows, each Triton result
checked against cuBLAS's. ``--dtype fp8`` times the fp8 products (``torch._scaled_mm``,
row-wise scales) at decode and prefill batches; ``--dtype bf16`` the 16-bit ones
(``F.linear``) at decode's few rows, the LM head too, with the weights' read rate against the
copy bandwidth (a batch-1 step is the weights read once). Each 16-bit product is timed as
the model runs it: the down projection with its SiLU in the Triton kernel's prologue, against
the SiLU-and-mul kernel and then cuBLAS; qkv and gate_up with the residual add and RMSNorm
before them in the Triton kernel's prologue, against the add + norm kernel and then cuBLAS.
With ``--write-tuning`` it writes,
for every class of rows and every weight shape, the faster implementation into the GPU's
matmul tuning file (that dtype's list; the other list, if the file has one, is kept).

    python benchmarks/gpu/gemm_bw.py [--dtype fp8|bf16] [--result-file FILE]
        [--write-tuning tokenmill/models/tuned/<gpu>.json]

Row classes (max rows, rows timed at): fp8 up to 16 (1), 64 (64), 256 (256), 512 (334: the
1,000 x 1,000 runs' batch), any (8,192: a prefill step); bf16 up to 1 (1), 8 (8), 16 (16).
Each figure is the median over calls that rotate over enough copies of the weight to keep it
out of L2, queued behind a spin kernel (benchmarks/gpu/attention_bw.py's timing). Without a
GPU it runs at toy sizes in Triton's interpreter, to check the script, not to time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attention_bw  # noqa: E402

from tokenmill.bench.report import markdown_table, now_iso, write_json  # noqa: E402
from tokenmill.kernels.fp8_activation import FP8_MAX  # noqa: E402
from tokenmill.kernels.triton import fused_ops  # noqa: E402
from tokenmill.kernels.triton import gemm as tg  # noqa: E402

# (name, N, K) of Llama-3.1-8B's linears, and its LM head (16-bit: the head stays bf16).
SHAPES = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
          ("down_proj", 4096, 14336)]
HEAD = [("lm_head", 128256, 4096)]
# The 16-bit products whose input the model computes in the Triton kernel's prologue, where
# Triton computes them: the down projection's SiLU-and-mul (GatedMLP), the add + RMSNorm
# before qkv and gate_up (RMSNorm.linear_forward). Each is timed that way, against the
# prologue's own kernel and then cuBLAS.
PROLOGUES = {"down_proj": "silu", "toy down_proj": "silu", "qkv_proj": "norm",
             "gate_up_proj": "norm", "toy qkv_proj": "norm"}
TOY_SHAPES = {"fp8": [("toy", 48, 64)],
              "bf16": [("toy", 48, 64), ("toy down_proj", 48, 32), ("toy qkv_proj", 40, 64)]}
# (max rows of the class, rows it is timed at); None: any number of rows.
CLASSES = {"fp8": [(16, 1), (64, 64), (256, 256), (512, 334), (None, 8192)],
           "bf16": [(1, 1), (8, 8), (16, 16)]}
TILES = {"fp8": [tg.GemmTile(*t) for t in (
    (16, 32, 256, 8, 4, 4), (16, 64, 256, 8, 4, 4), (64, 64, 128, 8, 4, 4),
    (64, 128, 128, 8, 4, 4), (128, 64, 128, 8, 4, 4), (128, 128, 128, 8, 8, 3),
    (128, 256, 128, 8, 8, 3))],
    # One 16-row tile (the rows padded) of narrow columns: many programs an SM, each streaming
    # its rows of the weight, deep or shallow pipelines.
    "bf16": [tg.GemmTile(*t) for t in (
        (16, 16, 256, 1, 4, 4), (16, 16, 512, 1, 4, 3), (16, 16, 1024, 1, 4, 2),
        (16, 32, 256, 1, 4, 4), (16, 32, 512, 1, 4, 3), (16, 32, 256, 1, 2, 5),
        (16, 64, 128, 1, 4, 5), (16, 64, 256, 1, 4, 4), (16, 128, 128, 1, 4, 4))]}
TOY_TILES = [tg.GemmTile(16, 16, 32, 8, 1, 2), tg.GemmTile(32, 16, 32, 2, 2, 2)]
# A Triton result further than this from cuBLAS's (relative norm) is not picked.
MAX_REL_ERR = 2e-2
# The tuning file's list of each dtype.
LIST = {"fp8": "fp8_gemm", "bf16": "gemm"}


def operands(fp8: bool, m: int, n: int, k: int, copies: int, device: torch.device,
             gen: torch.Generator, halves: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """``(x, scale_a, weights, scale_b)``: activations (``[m, halves * k]``), ``copies``
    weights of one shape, and their scales (unused for 16-bit)."""
    def values(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, device=device)
        if fp8:
            return (x * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return x.to(torch.bfloat16 if device.type == "cuda" else torch.float16)

    scale_a = torch.rand(m, 1, generator=gen, device=device) / 100 + 1e-3
    scale_b = torch.rand(1, n, generator=gen, device=device) / 100 + 1e-3
    return values(m, halves * k), scale_a, [values(n, k) for _ in range(copies)], scale_b


def products(fp8: bool, prologue: str | None, x: torch.Tensor, scale_a: torch.Tensor,
             scale_b: torch.Tensor, out_dtype: torch.dtype) -> tuple[Any, Any]:
    """``(cuBLAS's product of a weight, Triton's product of a weight at a tile)``; with
    prologue "silu", of ``silu(gate) * up`` for x's two halves (the SiLU-and-mul kernel
    first, or Triton's prologue); with "norm", of ``rms_norm(x + residual)`` (the add + norm
    kernel first, or Triton's prologue, each writing the sum as the model's layers do)."""
    if fp8:
        return (lambda w: torch._scaled_mm(x, w.t(), scale_a=scale_a, scale_b=scale_b,
                                           out_dtype=out_dtype),
                lambda w, tile: tg.scaled_mm(x, scale_a, w, scale_b, None, out_dtype, tile))
    if prologue == "silu":
        return (lambda w: F.linear(fused_ops.silu_and_mul(x), w),
                lambda w, tile: tg.matmul(x, w, None, tile, silu_mul=True))
    if prologue == "norm":
        residual = torch.randn_like(x)
        norm_w = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
        eps = 1e-5

        def triton_norm(w: torch.Tensor, tile: tg.GemmTile) -> torch.Tensor:
            norm = tg.NormPrologue(norm_w, eps, residual, torch.empty_like(x))
            return tg.matmul(x, w, None, tile, norm=norm)

        return (lambda w: F.linear(fused_ops.rms_norm(x, norm_w, eps, residual=residual)[0],
                                   w), triton_norm)
    return (lambda w: F.linear(x, w), lambda w, tile: tg.matmul(x, w, None, tile))


def merged_tuning(path: str, list_name: str, entries: list[dict[str, Any]],
                  header: dict[str, Any]) -> dict[str, Any]:
    """The file's JSON with ``list_name`` replaced by ``entries`` (its other list kept)."""
    data: dict[str, Any] = {}
    if Path(path).exists():
        data = json.loads(Path(path).read_text())
    return {**data, **header, list_name: entries}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=sorted(LIST), default="fp8")
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--write-tuning", default=None, metavar="FILE")
    a = ap.parse_args()
    fp8 = a.dtype == "fp8"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    out_dtype = torch.bfloat16 if gpu else torch.float32 if fp8 else torch.float16
    shapes = (SHAPES if fp8 else SHAPES + HEAD) if gpu else TOY_SHAPES[a.dtype]
    classes = CLASSES[a.dtype] if gpu else [(16, 3), (None, 20)]
    tiles = TILES[a.dtype] if gpu else TOY_TILES
    copy_gb_s = attention_bw.copy_bandwidth(device) / 1e9
    gen = torch.Generator(device=device).manual_seed(0)
    results: list[dict[str, Any]] = []
    rules: list[dict[str, Any]] = []
    table = []
    for name, n, k in shapes:
        copies = max(1, min(8, int(4e8 // (n * k)))) if gpu else 1
        weight_bytes = n * k * (1 if fp8 else 2)
        for max_m, m in classes:
            prologue = None if fp8 else PROLOGUES.get(name)
            x, scale_a, weights, scale_b = operands(fp8, m, n, k, copies, device, gen,
                                                    2 if prologue == "silu" else 1)
            cublas, triton_mm = products(fp8, prologue, x, scale_a, scale_b, out_dtype)
            ref = cublas(weights[0]).float()
            cublas_ms = attention_bw.time_ms([functools.partial(cublas, w) for w in weights],
                                             device)
            row = {"shape": name, "n": n, "k": k, "m": m, "max_m": max_m, "prologue": prologue,
                   "cublas_ms": cublas_ms, "triton": []}
            best = ("cublas", cublas_ms, None)
            for tile in tiles:
                try:
                    got = triton_mm(weights[0], tile)
                    err = ((got.float() - ref).norm() / ref.norm()).item()
                    ms = attention_bw.time_ms(
                        [functools.partial(triton_mm, w, tile) for w in weights], device)
                except Exception as e:  # a tile the compiler rejects (shared memory)
                    row["triton"].append({**asdict(tile), "error": str(e)[:200]})
                    continue
                row["triton"].append({**asdict(tile), "ms": ms, "rel_err_vs_cublas": err})
                if err <= MAX_REL_ERR and ms < best[1]:
                    best = ("triton", ms, tile)
            results.append(row)
            impl, ms, tile = best
            rules.append({"max_m": max_m, "n": n, "k": k, "impl": impl,
                          **(asdict(tile) if tile else {}), "ms": ms, "cublas_ms": cublas_ms})
            # fp8: the tensor cores' rate; 16-bit at a few rows: the weights' read rate.
            per_ms = (2 * m * n * k / 1e9 if fp8 else 100 * weight_bytes / 1e6 / copy_gb_s)
            label = name + {"silu": " (SiLU in)", "norm": " (add + norm in)"}.get(
                prologue or "", "")
            table.append([label, m, cublas_ms * 1000, per_ms / cublas_ms, ms * 1000, per_ms / ms,
                          "cuBLAS" if tile is None else
                          f"{tile.block_m}x{tile.block_n}x{tile.block_k}/{tile.num_warps}w"
                          f"/{tile.num_stages}s"])
            print(f"{name} m={m}: cuBLAS {cublas_ms * 1000:.1f} us, best {impl} "
                  f"{ms * 1000:.1f} us", flush=True)
    unit = "TFLOP/s" if fp8 else "% of copy"
    print(markdown_table(["linear", "rows", "cuBLAS us", f"cuBLAS {unit}", "best us",
                          f"best {unit}", "best"], table))
    device_name = torch.cuda.get_device_name(0) if gpu else "cpu (interpreter)"
    command = " ".join(["python", *sys.argv])
    if a.write_tuning:
        entries = [{k: v for k, v in r.items() if k not in ("ms", "cublas_ms")} for r in rules]
        data = merged_tuning(a.write_tuning, LIST[a.dtype], entries,
                             {"device": device_name, "created": now_iso(), "command": command,
                              "torch": torch.__version__})
        tg.parse_tuning(data, a.write_tuning)  # the engine must be able to read it
        write_json(a.write_tuning, data)
        print(f"wrote {a.write_tuning}")
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "device": device_name,
                                   "dtype": a.dtype, "copy_bandwidth_gb_s": copy_gb_s,
                                   "torch": torch.__version__, "command": command,
                                   "rules": rules, "results": results})


if __name__ == "__main__":
    main()
