"""The C++ kernels on tokenmill's own thread pool (tokenmill/kernels/cpu/thread_pool.h) against the
same kernels on OpenMP's threads (``TOKENMILL_THREAD_POOL=0``, what they ran on before), and
against the pool with spinning off (``TOKENMILL_SPIN_US=0``): each variant in its own
processes, alternated round by round, on the embedded model with its defaults.

    python benchmarks/thread_pool_ab.py --rounds 4 \
        --result-file benchmarks/results/thread-pool-ab-cpu.json

Workloads: ``bench latency`` (a 500-token prompt, 128 greedy tokens: decode and prefill
tokens/s) and ``bench throughput`` (32 random prompts of 128 tokens, 128 output tokens each).
The pool reads its variables when it starts, so the variants cannot share a process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

from tokenmill.bench.procs import run_json_job
from tokenmill.bench.report import hardware, now_iso, write_json

VARIANTS: dict[str, dict[str, str]] = {
    "openmp": {"TOKENMILL_THREAD_POOL": "0"},
    "pool": {},
    "pool-no-spin": {"TOKENMILL_SPIN_US": "0"},
}

# (workload, the result's key, unit, command after `tokenmill bench`)
MEASURES = [
    ("decode-1 after 500", "decode_tokens_per_s", "tok/s",
     ["latency", "--input-len", "500", "--output-len", "128", "--num-iters", "3",
      "--max-model-len", "1024"]),
    ("prefill-500", "prefill_tokens_per_s", "prompt tok/s", None),  # from the same run
    ("batch 32x128-128", "output_tokens_per_s", "output tok/s",
     ["throughput", "--num-prompts", "32", "--input-len", "128", "--output-len", "128",
      "--no-progress"]),
]


def run(variant: str, bench: list[str], threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "tokenmill", "-q", "bench", *bench, "--threads",
               str(threads), "--result-file", out]
        return run_json_job(cmd, out, extra_env=VARIANTS[variant])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {list(VARIANTS)}")
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    samples: dict[str, dict[str, list[float]]] = {m[0]: {v: [] for v in variants}
                                                  for m in MEASURES}
    loads: list[float] = []
    for r in range(args.rounds):
        # Rotate the order each round, so that no variant always runs first.
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            last: dict[str, Any] = {}
            for name, key, _, bench in MEASURES:
                if bench is not None:
                    loads.append(os.getloadavg()[0])
                    last = run(variant, bench, args.threads)
                samples[name][variant].append(float(last[key]))
                print(f"round {r + 1} {variant} {name}: {samples[name][variant][-1]:.1f}",
                      file=sys.stderr, flush=True)
    rows = [{"workload": name, "unit": unit, "samples": samples[name],
             "median": {v: statistics.median(x) for v, x in samples[name].items()}}
            for name, _, unit, _ in MEASURES]
    result = {"date": now_iso(), "hardware": hardware(), "threads": args.threads,
              "rounds": args.rounds, "variants": {v: VARIANTS[v] for v in variants},
              "load_average_before_each_run": loads,
              "command": " ".join(["python", *sys.argv]), "results": rows}
    print("| workload | unit | " + " | ".join(f"{v} (median)" for v in variants) + " |")
    print("| --- | --- |" + " ---: |" * len(variants))
    for row in rows:
        cells = [f"{row['median'][v]:.1f}" for v in variants]
        print(f"| {row['workload']} | {row['unit']} | " + " | ".join(cells) + " |")
    if args.result_file:
        write_json(args.result_file, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
