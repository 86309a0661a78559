"""The int8 output head's two CPU kernels side by side: ``int8_q16_linear`` (the weight as
stored, [N, K] rows) and ``int8_q16_tiles_linear`` (the weight repacked in output tiles), on the
embedded model's head shape (49,152 x 576), for a ladder of row counts. Both give the same bits
(tests/quant/test_int_dot.py); only the time differs.

Each call runs on a cold cache (a 64 MiB buffer is written between calls), as in a decode
step, where the layers' weights have pushed the head out of the last-level cache.

    python benchmarks/head_tiles.py --result-file benchmarks/results/head-tiles-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tokenmill  # noqa: F401  (its thread policy before torch's first parallel call)
from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json
from tokenmill.quant.kernel_choice import INT8_TILES_MIN_ROWS, cpu_kernels
from tokenmill.quant.packing import pack_int8_q16_tiles

N, K = 49152, 576


def cold_ms(fn, iters: int, junk: torch.Tensor) -> float:
    """Median milliseconds of ``fn`` with the caches flushed before each call."""
    times = []
    for i in range(iters + 2):
        junk.add_(1)
        start = time.perf_counter()
        fn()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    ext = cpu_kernels()
    if ext is None:
        raise SystemExit("tokenmill's C++ extension cannot be built here")
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
    scales = (torch.rand(N, generator=gen) * 0.01).bfloat16()
    tiles = pack_int8_q16_tiles(w)
    junk = torch.ones(64 << 20, dtype=torch.uint8)
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, K, generator=gen)
        assert torch.equal(ext.int8_q16_linear(x, w, scales),
                           ext.int8_q16_tiles_linear(x, tiles, scales, N))
        plain = cold_ms(lambda x=x: ext.int8_q16_linear(x, w, scales), args.iters, junk)
        tiled = cold_ms(lambda x=x: ext.int8_q16_tiles_linear(x, tiles, scales, N), args.iters,
                        junk)
        rows_out.append({"rows": m, "rows_ms": plain, "tiles_ms": tiled,
                         "tiles_gops": 2 * m * N * K / tiled / 1e6})
    hw = hardware()
    print(hardware_line(hw))
    print(f"int8 head {N} x {K}, int16 activations; the engine takes the tiles from "
          f"{INT8_TILES_MIN_ROWS} rows\n")
    print(markdown_table(["rows", "int8_q16_linear (ms)", "int8_q16_tiles_linear (ms)",
                          "speed-up", "tiles GOPS"],
                         [[r["rows"], f"{r['rows_ms']:.3f}", f"{r['tiles_ms']:.3f}",
                           f"{r['rows_ms'] / r['tiles_ms']:.2f}x", f"{r['tiles_gops']:.0f}"]
                          for r in rows_out]))
    if args.result_file:
        write_json(args.result_file, {"date": now_iso(), "hardware": hw, "shape": [N, K],
                                      "tiles_min_rows": INT8_TILES_MIN_ROWS, "rows": rows_out,
                                      "command": "python benchmarks/head_tiles.py"})


if __name__ == "__main__":
    main()
