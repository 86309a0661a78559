"""The fp8 activation kernels alone, against the copy bandwidth: per-row quantization of a
linear's input (``quantize_rows_fp8``, o_proj's) and SiLU-and-mul quantized on the way out
(``silu_and_mul_fp8``, down_proj's), each launched as the engine launches it (a row of up to
16,384 columns read once and kept in registers) and the older way (blocks of 2,048 columns,
each row read twice), side by side on the same inputs, bytes checked equal.

    python benchmarks/gpu/row_quant_bw.py [--rows 1,64,256,334] [--result-file FILE]

Llama-3.1-8B's widths: o_proj's input has 4,096 columns, down_proj's 14,336 (gate_up's
output, 28,672). Bytes a call moves: the input once, the e4m3 output and the scales; the
older way's second read mostly hits L2, so its GB/s is not a share of DRAM traffic. Without
a GPU it runs at toy sizes in Triton's interpreter, to check the script, not to time.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention_bw import copy_bandwidth, time_ms  # noqa: E402

from tokenmill.bench.report import markdown_table, now_iso, write_json  # noqa: E402
from tokenmill.kernels.fp8_activation import FP8_MAX  # noqa: E402
from tokenmill.kernels.triton import fp8 as fk  # noqa: E402
from tokenmill.kernels.triton import fused_ops as fo  # noqa: E402

# The older launch: blocks of 2,048 columns at 4 warps, two passes over every row.
TWO_PASS = (2048, 4, False)


def quantize_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  launch: tuple[int, int, bool]) -> None:
    block, warps, one_pass = launch
    fk._quantize_rows_kernel[(x.shape[0],)](x, q, scale, x.shape[1], x.stride(0), q.stride(0),
                                            FP8_MAX, BLOCK=block, ONE_PASS=one_pass,
                                            num_warps=warps)


def silu_and_mul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 launch: tuple[int, int, bool]) -> None:
    block, warps, one_pass = launch
    fo._silu_and_mul_fp8_kernel[(x.shape[0],)](x, q, scale, q.shape[1], x.stride(0),
                                               q.stride(0), FP8_MAX, BLOCK=block,
                                               ONE_PASS=one_pass, num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="comma-separated batch sizes")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    rows_list = [int(r) for r in (a.rows or ("1,64,256,334" if gpu else "1,3")).split(",")]
    dtype = torch.bfloat16 if gpu else torch.float32
    out_dtype = torch.float8_e4m3fn if gpu else torch.float32  # the interpreter casts wrongly
    widths = {"quantize_rows (o_proj input)": (quantize_rows, 4096 if gpu else 100, 1),
              "silu_and_mul (down_proj input)": (silu_and_mul, 14336 if gpu else 300, 2)}
    bw = copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(0)
    results: list[dict[str, Any]] = []
    table = []
    for name, (fn, cols, inputs_per_col) in widths.items():
        for rows in rows_list:
            # Enough separate inputs (up to 32, one a layer) to keep them out of L2.
            per_call = rows * cols * inputs_per_col * (2 if gpu else 4)
            copies = max(1, min(32, int(2e8 // per_call))) if gpu else 1
            xs = [torch.randn(rows, cols * inputs_per_col, generator=gen, device=device,
                              dtype=torch.float32).to(dtype) for _ in range(copies)]
            outs = {}
            row = {"kernel": name, "rows": rows, "cols": cols}
            for label, launch in (("engine", fo.fp8_row_launch(cols)), ("two-pass", TWO_PASS)):
                q = torch.empty(rows, cols, dtype=out_dtype, device=device)
                scale = torch.empty(rows, 1, dtype=torch.float32, device=device)
                fn(xs[0], q, scale, launch)
                outs[label] = (q.view(torch.uint8) if gpu else q, scale)
                ms = time_ms([functools.partial(fn, x, q, scale, launch) for x in xs], device)
                moved = per_call + rows * cols + rows * 4
                row[f"{label}_us"] = ms * 1000
                row[f"{label}_share_of_copy"] = moved / (ms / 1000) / bw if gpu else float("nan")
                row[f"{label}_launch"] = list(launch)
            row["same_bytes"] = (torch.equal(outs["engine"][0], outs["two-pass"][0])
                                 and torch.equal(outs["engine"][1], outs["two-pass"][1]))
            results.append(row)
            table.append([name, rows, cols, row["engine_us"], row["engine_share_of_copy"],
                          row["two-pass_us"], row["two-pass_share_of_copy"], row["same_bytes"]])
    print(markdown_table(["kernel", "rows", "cols", "one pass us", "share of copy",
                          "two passes us", "share of copy", "same bytes"], table))
    name = torch.cuda.get_device_name(0) if gpu else "cpu (interpreter)"
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s on {name}")
    if not all(r["same_bytes"] for r in results):
        raise SystemExit("the two launches gave different bytes")
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "device": name,
                                   "torch": torch.__version__, "copy_bandwidth_gb_s": bw / 1e9,
                                   "command": " ".join(["python", *sys.argv]),
                                   "results": results})


if __name__ == "__main__":
    main()
