"""What accounting and drift monitoring cost 32-stream HTTP throughput: `tokenmill serve`
variants side by side (idle servers use no CPU), `tokenmill bench serve` against each in turn,
the order rotated every round. Besides throughput, each server's CPU time per output token of
each run (from /proc), which a busy neighbour disturbs far less.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/monitoring_ab.py --rounds 4 \
        --variant on= --variant off=--no-monitor \
        --variant base=--no-monitor@/tmp/tm-base \
        --result-file benchmarks/results/monitoring-ab-cpu.json

A variant is NAME=SERVE_ARGS[@SOURCE]: SOURCE is another checkout of tokenmill to serve from
(its PYTHONPATH), e.g. the commit before accounting; the load generator always runs from this
one. Each server gets its own free port; they start before the first round and stop after the
last.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from tokenmill.bench.report import hardware, now_iso, write_json

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, args: list[str], source: str | None) -> tuple[subprocess.Popen, str]:
    """Start one server variant; its URL once /health answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": source or os.environ.get("PYTHONPATH", "")}
    log = open(os.path.join(tempfile.gettempdir(), f"monitoring-ab-{name}.log"), "w")
    cmd = [sys.executable, "-m", "tokenmill", "-q", "serve", "--port", str(port),
           "--max-num-seqs", "32", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=source or None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} did not start in {START_TIMEOUT_S} s")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) the process has used so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(url: str, num_prompts: int, input_len: int, output_len: int, seed: int) -> float:
    """Output tokens/s of one `tokenmill bench serve` run with 32 streams."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "tokenmill", "-q", "bench", "serve",
                        "--base-url", url, "--max-concurrency", "32",
                        "--num-prompts", str(num_prompts), "--input-len", str(input_len),
                        "--output-len", str(output_len), "--seed", str(seed),
                        "--no-progress", "--result-file", out.name],
                       check=True, stdout=subprocess.DEVNULL)
        return json.load(open(out.name))["output_throughput"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, metavar="NAME=ARGS[@SOURCE]")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    variants = {}
    for v in args.variant:
        name, _, rest = v.partition("=")
        serve_args, _, source = rest.partition("@")
        variants[name] = (shlex.split(serve_args), source or None)
    servers = {name: start(name, a, s) for name, (a, s) in variants.items()}
    results: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    loads: list[float] = []
    try:
        names = list(variants)
        for name in names:  # warm-up: first requests pay one-time costs
            bench(servers[name][1], 32, args.input_len, 8, seed=10_000)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                # Every variant sees the same prompts in a round, new ones every round.
                before = cpu_seconds(servers[name][0].pid)
                results[name].append(bench(servers[name][1], args.num_prompts, args.input_len,
                                           args.output_len, seed=r))
                # The server's CPU time for the run's output tokens: far less sensitive to
                # neighbours than throughput (it does not count the time a thread waits).
                cpu[name].append((cpu_seconds(servers[name][0].pid) - before) * 1000
                                 / (args.num_prompts * args.output_len))
                loads.append(os.getloadavg()[0])
            print(f"round {r + 1}: " + ", ".join(
                f"{n} {results[n][-1]:.1f} tok/s {cpu[n][-1]:.2f} CPU ms/token" for n in names),
                flush=True)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(60)
    summary = summarize(results, names[0])
    cpu_summary = summarize(cpu, names[0])
    for row in cpu_summary:
        print(f"{row['variant']:>8}: median {row['median']:.3f} server CPU ms per output token, "
              f"vs {names[0]}: {row['paired_vs_first']:+.2%} (median of the rounds' ratios)")
    for row in summary:
        print(f"{row['variant']:>8}: median {row['median']:.1f} output tok/s, best "
              f"{row['best']:.1f}, vs {names[0]}: {row['vs_first']:+.2%} (medians), "
              f"{row['paired_vs_first']:+.2%} (median of the rounds' ratios)")
    if args.result_file:
        write_json(args.result_file, {
            "benchmark": "monitoring-ab", "date": now_iso(), "hardware": hardware(),
            "variants": {n: {"serve_args": a, "source": s} for n, (a, s) in variants.items()},
            "workload": {"streams": 32, "num_prompts": args.num_prompts,
                         "input_len": args.input_len, "output_len": args.output_len},
            "rounds": results, "load_avg_after_each_run": loads, "summary": summary,
            "cpu_ms_per_output_token": cpu, "cpu_summary": cpu_summary,
            "command": "python benchmarks/monitoring_ab.py " + " ".join(sys.argv[1:])})
    return 0


def summarize(results: dict[str, list[float]], first: str) -> list[dict[str, Any]]:
    """Each variant's median and best, and against the first variant: the ratio of medians and
    the median of the rounds' ratios (each round's runs are back to back, so a slow drift of
    the machine's speed cancels out of a round's ratio)."""
    base = statistics.median(results[first])
    rows = []
    for n, v in results.items():
        paired = [x / b - 1 for x, b in zip(v, results[first], strict=True)]
        rows.append({"variant": n, "median": statistics.median(v), "best": max(v),
                     "vs_first": statistics.median(v) / base - 1,
                     "paired_vs_first": statistics.median(paired), "paired": paired, "runs": v})
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
