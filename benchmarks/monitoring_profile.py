"""Where a `tokenmill serve` process spends its time under 32 streams, attributed to the unit
economics and the drift monitor: py-spy samples the whole server (every thread) while
`tokenmill bench serve` runs against it, and each sample whose stack passes through the
accounting, the monitor or the monitor's prompt embeddings is counted as theirs.

    pip install py-spy
    OMP_WAIT_POLICY=PASSIVE python benchmarks/monitoring_profile.py \
        --result-file benchmarks/results/monitoring-profile-cpu.json

An A/B of two server processes (benchmarks/monitoring_ab.py) cannot resolve a cost of 1-2%
here: two processes of the same code differ by more than that. Samples of one process can.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tokenmill.bench.procs import free_port, start_server
from tokenmill.bench.report import hardware, now_iso, write_json

# A sample belongs to a part when any frame of its stack is in one of these places.
PARTS = {
    "accounting": ("tokenmill/metrics/economics.py",),
    "monitor": ("tokenmill/monitoring/", "tokenmill/server/monitoring.py"),
    "prompt_embeddings": ("tokenmill/models/bert.py",),
    "engine_steps": ("EngineCore.step",),
}


def attribute(raw_path: str) -> dict[str, int]:
    """Samples per part, and all of them (py-spy's raw format: one stack and a count a line)."""
    counts: collections.Counter[str] = collections.Counter()
    with open(raw_path, encoding="utf-8") as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not n.isdigit():
                continue
            counts["all"] += int(n)
            for part, marks in PARTS.items():
                if any(mark in stack for mark in marks):
                    counts[part] += int(n)
    return dict(counts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    port = free_port()
    server = start_server([sys.executable, "-m", "tokenmill", "-q", "serve", "--port", str(port),
                           "--max-num-seqs", "32"], port)
    bench = [sys.executable, "-m", "tokenmill", "-q", "bench", "serve", "--base-url",
             server.base_url, "--max-concurrency", "32", "--input-len", str(args.input_len),
             "--no-progress"]
    try:
        # Warm-up: the first steps pay one-time costs.
        subprocess.run([*bench, "--num-prompts", "32", "--output-len", "8"], check=True,
                       stdout=subprocess.DEVNULL)
        raw = tempfile.NamedTemporaryFile(suffix=".txt", delete=False).name
        spy = subprocess.Popen(["py-spy", "record", "-p", str(server.proc.pid), "-r",
                                str(args.rate), "-f", "raw", "-o", raw, "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([*bench, "--num-prompts", str(args.num_prompts), "--output-len",
                            str(args.output_len), "--result-file", out.name], check=True,
                           stdout=subprocess.DEVNULL)
            throughput = json.load(open(out.name))["output_throughput"]
        spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
        spy.wait(60)
    finally:
        server.stop()
    counts = attribute(raw)
    os.remove(raw)
    steps = counts.get("engine_steps", 0)
    shares = {part: counts.get(part, 0) / steps if steps else None
              for part in ("accounting", "monitor", "prompt_embeddings")}
    print(f"{counts.get('all', 0)} samples, {steps} in engine steps; "
          f"output throughput {throughput:.1f} tok/s")
    for part, share in shares.items():
        print(f"{part:>18}: {counts.get(part, 0):>6} samples, {share:.2%} of the engine steps'")
    if args.result_file:
        write_json(args.result_file, {
            "benchmark": "monitoring-profile", "date": now_iso(), "hardware": hardware(),
            "load_avg": os.getloadavg(), "samples": counts, "share_of_engine_steps": shares,
            "output_throughput": throughput,
            "workload": {"streams": 32, "num_prompts": args.num_prompts,
                         "input_len": args.input_len, "output_len": args.output_len},
            "command": "python benchmarks/monitoring_profile.py " + " ".join(sys.argv[1:])})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
