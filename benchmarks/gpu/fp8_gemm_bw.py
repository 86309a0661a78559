"""The fp8 linears of Llama-3.1-8B alone: cuBLAS (``torch._scaled_mm``) against the Triton
kernel of ``tokenmill/quant/fp8_gemm.py`` at several tile shapes, by batch rows, with each
Triton result checked against cuBLAS's. With ``--write-tuning`` it writes, for every class of
rows and every weight shape, the faster implementation as the GPU's fp8 matmul tuning file.

    python benchmarks/gpu/fp8_gemm_bw.py [--result-file FILE]
        [--write-tuning tokenmill/quant/tuned/<gpu>.json]

Rows classes and the rows each is timed at: up to 16 (1), 64 (64), 256 (256), 512 (334: the
1,000 x 1,000 runs' batch), any (8,192: a prefill step). Each figure is the median over
calls that rotate over enough copies of the weight to keep it out of L2, queued behind a spin
kernel (benchmarks/gpu/attention_bw.py's timing). Without a GPU it runs at toy sizes in
Triton's interpreter, to check the script, not to time.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import asdict
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attention_bw  # noqa: E402

from tokenmill.bench.report import markdown_table, now_iso, write_json  # noqa: E402
from tokenmill.models.fp8_activation import FP8_MAX  # noqa: E402
from tokenmill.quant import fp8_gemm as fg  # noqa: E402

# (name, N, K) of Llama-3.1-8B's linears.
SHAPES = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
          ("down_proj", 4096, 14336)]
# (max rows of the class, rows it is timed at); the last class is for any number of rows.
CLASSES = [(16, 1), (64, 64), (256, 256), (512, 334), (None, 8192)]
TILES = [fg.GemmTile(*t) for t in (
    (16, 32, 256, 8, 4, 4), (16, 64, 256, 8, 4, 4), (64, 64, 128, 8, 4, 4),
    (64, 128, 128, 8, 4, 4), (128, 64, 128, 8, 4, 4), (128, 128, 128, 8, 8, 3),
    (128, 256, 128, 8, 8, 3))]
# A Triton result further than this from cuBLAS's (relative norm) is not picked.
MAX_REL_ERR = 2e-2


def operands(m: int, n: int, k: int, copies: int, device: torch.device,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor],
                                            torch.Tensor]:
    def e4m3(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, device=device) * 100
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    scale_a = torch.rand(m, 1, generator=gen, device=device) / 100 + 1e-3
    scale_b = torch.rand(1, n, generator=gen, device=device) / 100 + 1e-3
    return e4m3(m, k), scale_a, [e4m3(n, k) for _ in range(copies)], scale_b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--write-tuning", default=None, metavar="FILE")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    out_dtype = torch.bfloat16 if gpu else torch.float32
    shapes = SHAPES if gpu else [("toy", 48, 64)]
    classes = CLASSES if gpu else [(16, 3), (None, 20)]
    tiles = TILES if gpu else [fg.GemmTile(16, 16, 32, 8, 1, 2), fg.GemmTile(32, 16, 32, 2, 2, 2)]
    gen = torch.Generator(device=device).manual_seed(0)
    results: list[dict[str, Any]] = []
    rules: list[dict[str, Any]] = []
    table = []
    for name, n, k in shapes:
        copies = max(1, min(8, int(4e8 // (n * k)))) if gpu else 1
        for max_m, m in classes:
            x, scale_a, weights, scale_b = operands(m, n, k, copies, device, gen)
            ref = torch._scaled_mm(x, weights[0].t(), scale_a=scale_a, scale_b=scale_b,
                                   out_dtype=out_dtype).float()
            cublas_ms = attention_bw.time_ms(
                [functools.partial(torch._scaled_mm, x, w.t(), scale_a=scale_a,
                                   scale_b=scale_b, out_dtype=out_dtype) for w in weights],
                device)
            row = {"shape": name, "n": n, "k": k, "m": m, "max_m": max_m,
                   "cublas_ms": cublas_ms, "triton": []}
            best = ("cublas", cublas_ms, None)
            for tile in tiles:
                try:
                    got = fg.scaled_mm(x, scale_a, weights[0], scale_b, None, out_dtype, tile)
                    err = ((got.float() - ref).norm() / ref.norm()).item()
                    ms = attention_bw.time_ms(
                        [functools.partial(fg.scaled_mm, x, scale_a, w, scale_b, None,
                                           out_dtype, tile) for w in weights], device)
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
            flops = 2 * m * n * k
            table.append([name, m, cublas_ms * 1000, flops / (cublas_ms / 1000) / 1e12,
                          ms * 1000, flops / (ms / 1000) / 1e12,
                          "cuBLAS" if tile is None else
                          f"{tile.block_m}x{tile.block_n}x{tile.block_k}/{tile.num_warps}w"
                          f"/{tile.num_stages}s"])
            print(f"{name} m={m}: cuBLAS {cublas_ms * 1000:.1f} us, best {impl} "
                  f"{ms * 1000:.1f} us", flush=True)
    print(markdown_table(["linear", "rows", "cuBLAS us", "cuBLAS TFLOP/s", "best us",
                          "best TFLOP/s", "best"], table))
    device_name = torch.cuda.get_device_name(0) if gpu else "cpu (interpreter)"
    command = " ".join(["python", *sys.argv])
    if a.write_tuning:
        entries = [{k: v for k, v in r.items() if k not in ("ms", "cublas_ms")} for r in rules]
        data = {"device": device_name, "created": now_iso(), "command": command,
                "torch": torch.__version__, "fp8_gemm": entries}
        fg.parse_tuning(data, a.write_tuning)  # the engine must be able to read it
        write_json(a.write_tuning, data)
        print(f"wrote {a.write_tuning}")
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "device": device_name,
                                   "torch": torch.__version__, "command": command,
                                   "rules": rules, "results": results})


if __name__ == "__main__":
    main()
