"""The scheduler's two step policies side by side: ``--prefill-first`` (the default: prompts
that fit in a step go before the running decodes) against ``--no-prefill-first`` (every step
carries the decodes first, prompt chunks take what is left), on `tokenmill bench compare`'s
multi-stream workload, with llama.cpp's `llama-server` (``-np`` = streams) as the reference.

    python benchmarks/scheduling_ab.py --rounds 2 --concurrency 16,32 \
        --result-file benchmarks/results/scheduling-ab-cpu.json

Each round starts every variant's server anew and runs the load generator at each level (the
same random 128-token prompts, 128 output tokens, 2 requests per stream); the order of the
variants is reversed every other round, and the table gives each one's median over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

from tokenmill.bench.compare import (
    BLOCK_SIZE,
    DEFAULT_LLAMA_SERVER,
    MAX_MODEL_LEN,
    CompareConfig,
    Workloads,
    prepare_workloads,
    sweep,
    sweep_llama_server,
)
from tokenmill.bench.procs import free_port
from tokenmill.bench.report import hardware, now_iso, write_json
from tokenmill.core.kv_cache import blocks_for_tokens
from tokenmill.model_loader.gguf import embedded_model_path

VARIANTS: dict[str, list[str]] = {
    "prefill-first": ["--prefill-first"],
    "decodes-first": ["--no-prefill-first"],
}
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def run_tokenmill(cfg: CompareConfig, wl: Workloads, extra: list[str]) -> dict[str, Any]:
    """One `tokenmill serve` with compare's engine options, swept over the levels."""
    streams = max(cfg.levels)
    blocks = streams * blocks_for_tokens(cfg.serve_input_len + cfg.output_len, BLOCK_SIZE)
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill", "-q", "serve", "--port", str(port), "--model",
           cfg.model, "--threads", str(cfg.threads), "--max-model-len", str(MAX_MODEL_LEN),
           "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(blocks), "--max-num-seqs",
           str(streams), *extra]
    return sweep(cmd, port, cfg, wl)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", default="16,32")
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER,
                   help="the reference; '' to leave it out")
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    cfg = CompareConfig(model=embedded_model_path(), threads=args.threads, peers_python="",
                        levels=[int(c) for c in args.concurrency.split(",")])
    names = list(VARIANTS)
    if args.llama_server and os.path.exists(args.llama_server):
        cfg.llama_server = args.llama_server
        names.append("llama-server")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as folder:
        wl = prepare_workloads(cfg, folder)
        for r in range(args.rounds):
            # ABBA: every other round runs the variants in reverse order.
            for name in (names if r % 2 == 0 else names[::-1]):
                print(f"round {r + 1}: {name}", file=sys.stderr)
                if name == "llama-server":
                    result = sweep_llama_server(cfg, wl)
                else:
                    result = run_tokenmill(cfg, wl, VARIANTS[name])
                runs[name].append(result)
    summary = {name: {str(c): {m: statistics.median(run["levels"][str(c)][m] for run in rs)
                               for m in METRICS} for c in cfg.levels}
               for name, rs in runs.items()}
    print(f"\n| streams | system | {' | '.join(METRICS)} |")
    print("| --- | --- |" + " ---: |" * len(METRICS))
    for c in cfg.levels:
        for name in names:
            row = summary[name][str(c)]
            print(f"| {c} | {name} | " + " | ".join(f"{row[m]:,.1f}" for m in METRICS) + " |")
    if args.result_file:
        write_json(args.result_file, {
            "date": now_iso(), "hardware": hardware(), "rounds": args.rounds,
            "levels": cfg.levels, "requests_per_level": [2 * c for c in cfg.levels],
            "input_len": cfg.serve_input_len, "output_len": cfg.output_len,
            "summary_median": summary, "runs": runs,
            "command": " ".join(["python", *sys.argv])})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
