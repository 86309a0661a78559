"""Time the CPU K-quant matmuls (tokenmill/kernels/cpu/kquant.h) against the int8 path they
replace (the file's K-quants widened to int8 per channel, ``Int8WeightOnlyLinear``) and against
dequantizing the weight for one dense bf16 / fp32 matmul, by row count: which route is faster
where sets ``KQUANT_DENSE_MIN_ROWS`` (tokenmill/quant/kquant.py).

Usage: OMP_NUM_THREADS=1 python benchmarks/kquant_kernels.py [--out benchmarks/results/kquant-kernels-cpu]
   -> prints a table, writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from tokenmill.kernels.cpu import load_extension
from tokenmill.quant.kquant import KQuantLinear
from tokenmill.quant.linear import Int8WeightOnlyLinear

# (name, N, K): SmolLM2-135M's MLP and a 1B-class model's square and MLP projections.
SHAPES = [("smollm2 down", 576, 1536), ("1B o_proj", 2048, 2048), ("1B gate_up", 16384, 2048)]
TYPES = [Q.Q4_K, Q.Q6_K, Q.Q8_0]
ROWS = [1, 4, 16, 32, 64, 128, 512]


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> torch.Tensor:
    from gguf.constants import GGML_QUANT_SIZES

    elems, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
    off = {Q.Q6_K: 208}.get(qtype, 0)
    half = rng.uniform(0.0005, 0.002, blocks.shape[:2]).astype(np.float16)
    blocks[..., off:off + 2] = half[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def measure(ext, qtype: Q, n: int, k: int, rows: int) -> dict[str, float]:
    blocks = random_blocks(qtype, n, k)
    layer = KQuantLinear([(blocks, qtype)], k, None)
    int8 = Int8WeightOnlyLinear.from_weight(layer.dequantize(), None)
    x = torch.randn(rows, k).bfloat16()
    repeats = max(3, min(50, int(2e8 / (rows * n * k))))
    kernel = best_ms(lambda: ext.kquant_linear(x, layer.weight, layer.segments), repeats)
    layer.dense_min_rows = 1
    dense = best_ms(lambda: layer(x), repeats)
    int8_ms = best_ms(lambda: int8(x), repeats)
    return {"kquant_ms": kernel, "dense_ms": dense, "int8_ms": int8_ms,
            "kquant_bytes": layer.weight.nbytes, "int8_bytes": int8.weight.nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/kquant-kernels-cpu")
    args = parser.parse_args()
    ext = load_extension()
    results = []
    for name, n, k in SHAPES:
        for qtype in TYPES:
            for rows in ROWS:
                r = {"shape": name, "n": n, "k": k, "type": qtype.name, "rows": rows,
                     **measure(ext, qtype, n, k, rows)}
                results.append(r)
                print(f"{name:14s} {qtype.name:5s} rows {rows:4d}: kquant {r['kquant_ms']:8.3f} ms"
                      f"  dense {r['dense_ms']:8.3f}  int8 {r['int8_ms']:8.3f}", flush=True)
    meta = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "command": "OMP_NUM_THREADS=1 python benchmarks/kquant_kernels.py"}
    try:
        meta["cpu"] = next(line.split(":", 1)[1].strip() for line in
                           open("/proc/cpuinfo", encoding="utf-8") if "model name" in line)
    except (OSError, StopIteration):
        pass
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [f"# K-quant CPU kernels vs int8 and dense ({meta['cpu']})", "",
             f"`{meta['command']}`; best of several calls, ms a call.", "",
             "| shape | type | rows | kquant | dense (dequantize + matmul) | int8 (widened) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['type']} | {r['rows']} | {r['kquant_ms']:.3f} | "
              f"{r['dense_ms']:.3f} | {r['int8_ms']:.3f} |" for r in results]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
