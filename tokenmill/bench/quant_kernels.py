"""Time the weight-only kernels against float matmuls on this CPU, for every path a quantized
layer can take, at decode (1 row) and prefill (32-512 rows) sizes.

    python -m tokenmill.bench.quant_kernels --threads 2 --result-file out.json

The "kernel" columns are tokenmill's own int kernels as the layers run them by default: on
int16 activations (``tokenmill/kernels/cpu/int_dot.h``); "int8-act" the int4 kernel on int8
activations (``TOKENMILL_INT4_ACT_BITS=8``), "fp32-act" the fp32 kernels
(``tokenmill/kernels/cpu/quant_gemm.h``, ``TOKENMILL_INT_ACTIVATIONS=0``), "PyTorch kernel"
``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``.
Each cell is the fastest of many calls (the minimum is the least disturbed by other work on
the machine) in microseconds, activations fp32 in and out as the model has them. This is
where ``INT8_DENSE_MIN_ROWS`` / ``INT4_DENSE_MIN_ROWS`` in ``tokenmill.quant.linear`` come from.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.bench.report import hardware, now_iso, write_json
from tokenmill.quant import kernel_choice
from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

# (name, out_features, in_features): SmolLM2-135M's projections and its tied head.
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("head", 49152, 576)]
ROWS = [1, 8, 32, 64, 128, 512]
NEVER, ALWAYS = 10**9, 1


def best_time_us(fn: Callable[[], object], budget_s: float) -> float:
    """The fastest of as many calls of ``fn`` as fit in ``budget_s`` (at least 5)."""
    for _ in range(2):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def _variants(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    w_bf16 = w.bfloat16()
    int8 = Int8WeightOnlyLinear.from_weight(w, None)
    int4_32 = Int4WeightOnlyLinear.from_weight(w, None, 32)
    int4_64 = Int4WeightOnlyLinear.from_weight(w, None, 64)

    def path(module: Int8WeightOnlyLinear | Int4WeightOnlyLinear, rows: int
             ) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            module.dense_min_rows = rows
            return module(x)
        return run

    def switched(module: Int8WeightOnlyLinear | Int4WeightOnlyLinear, *, cpu_kernels: bool = True,
                 int_activations: bool = True, int4_bits: int = 16
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The module's int kernel at every row count, with tokenmill.quant.linear's switches
        set as given for the call (PyTorch's kernel: cpu_kernels False)."""
        def run(x: torch.Tensor) -> torch.Tensor:
            module.dense_min_rows = NEVER
            saved = (kernel_choice.USE_CPU_KERNELS, kernel_choice.USE_INT_ACTIVATIONS, kernel_choice.INT4_ACT_BITS)
            kernel_choice.USE_CPU_KERNELS = cpu_kernels
            kernel_choice.USE_INT_ACTIVATIONS = int_activations
            kernel_choice.INT4_ACT_BITS = int4_bits
            try:
                return module(x)
            finally:
                (kernel_choice.USE_CPU_KERNELS, kernel_choice.USE_INT_ACTIVATIONS,
                 kernel_choice.INT4_ACT_BITS) = saved
        return run

    return {
        "fp32": lambda x: F.linear(x, w),
        "bf16": lambda x: F.linear(x.bfloat16(), w_bf16).float(),
        "int8 kernel": switched(int8), "int8 fp32-act kernel": switched(int8, int_activations=False),
        "int8 PyTorch kernel": switched(int8, cpu_kernels=False), "int8 dense": path(int8, ALWAYS),
        "int4 g32 kernel": switched(int4_32),
        "int4 g32 int8-act kernel": switched(int4_32, int4_bits=8),
        "int4 g32 fp32-act kernel": switched(int4_32, int_activations=False),
        "int4 g32 PyTorch kernel": switched(int4_32, cpu_kernels=False),
        "int4 g32 dense": path(int4_32, ALWAYS), "int4 g64 kernel": switched(int4_64),
    }


@torch.inference_mode()
def run(rows_list: list[int], budget_s: float) -> list[dict[str, object]]:
    """One record per (shape, rows) with the time of every variant."""
    records: list[dict[str, object]] = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        variants = _variants(torch.randn(n, k, generator=gen) * 0.02)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen)
            times = {v: round(best_time_us(lambda f=f, x=x: f(x), budget_s), 1)
                     for v, f in variants.items()}
            records.append({"shape": name, "out": n, "in": k, "rows": rows, "us": times})
            print(f"{name:8s} {n:6d}x{k:<5d} rows={rows:<4d} " +
                  "  ".join(f"{v}={t:.0f}" for v, t in times.items()), flush=True)
    return records


def markdown(records: list[dict[str, object]]) -> str:
    """One row per (shape, rows), microseconds; the fastest int-weight variant in bold."""
    variants = list(records[0]["us"])  # type: ignore[arg-type]
    lines = ["| layer (out x in) | rows | " + " | ".join(variants) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in variants) + " |"]
    for r in records:
        us: dict[str, float] = r["us"]  # type: ignore[assignment]
        fastest = min((v for v in us if v.startswith("int")), key=us.__getitem__)
        cells = [f"**{us[v]:,.0f}**" if v == fastest else f"{us[v]:,.0f}" for v in variants]
        lines.append(f"| {r['shape']} ({r['out']}x{r['in']}) | {r['rows']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the timings; optionally write them as JSON."""
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.quant_kernels",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rows", type=int, nargs="+", default=ROWS)
    p.add_argument("--budget", type=float, default=0.3, help="seconds per cell")
    p.add_argument("--result-file", default=None)
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="also write the table as markdown (bold: the fastest int-weight path)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    records = run(args.rows, args.budget)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(records) + "\n")
    if args.result_file:
        write_json(args.result_file, {"benchmark": "quant-kernels", "timestamp": now_iso(),
                                      "hardware": hardware(), "threads": torch.get_num_threads(),
                                      "unit": "microseconds, best of many", "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
