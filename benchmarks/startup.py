"""Start-up time and memory of `tokenmill serve` (the default: the embedded chat model and the
embedding model): seconds from launch until /health answers 200, resident memory then, and the
peak resident memory after 32 concurrent streams of 128 + 128 tokens.

Each ``--tree`` is a checkout of tokenmill, run with its own code (PYTHONPATH) so that two
commits can be compared in one run; the rounds alternate between them.

    python benchmarks/startup.py [--tree NAME=DIR ...] [--rounds 3] [--result-file FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from tokenmill.bench.procs import free_port
from tokenmill.bench.report import (
    hardware,
    hardware_line,
    markdown_table,
    now_iso,
    process_peak_rss_mib,
    write_json,
)

HERE = os.path.dirname(os.path.abspath(__file__))
START_TIMEOUT_S = 600.0


def rss_mib(pid: int) -> float:
    """The process's resident memory now (VmRSS), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def one_start(tree: str, load: bool) -> dict[str, Any]:
    """Launch the server of ``tree``, time it to healthy, read its memory (after a 32-stream
    load when ``load``), stop it."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": tree}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--port", str(port)],
                            cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server of {tree} exited with {proc.returncode}")
            if time.monotonic() - started > START_TIMEOUT_S:
                raise RuntimeError(f"the server of {tree} was not healthy in {START_TIMEOUT_S} s")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        out = {"healthy_s": time.monotonic() - started, "rss_ready_mib": rss_mib(proc.pid)}
        if load:
            subprocess.run([sys.executable, "-m", "tokenmill", "-q", "bench", "serve",
                            "--base-url", f"http://127.0.0.1:{port}", "--dataset", "random",
                            "--num-prompts", "32", "--input-len", "128", "--output-len", "128",
                            "--max-concurrency", "32", "--request-rate", "inf", "--seed", "0"],
                           check=True, stdout=subprocess.DEVNULL, cwd=tree, env=env)
            out["peak_rss_32_streams_mib"] = process_peak_rss_mib(proc.pid)
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[],
                    help="NAME=DIR: a tokenmill checkout to measure (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree) or {"this": os.path.dirname(HERE)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for r in range(a.rounds):
        for name, tree in trees.items():
            # The last round also serves 32 streams, for the peak memory.
            runs[name].append(one_start(os.path.abspath(tree), load=r == a.rounds - 1))
            print(name, r, runs[name][-1], flush=True)
    rows, summary = [], {}
    for name, rs in runs.items():
        later = [x["healthy_s"] for x in rs[1:]] or [rs[0]["healthy_s"]]
        summary[name] = {"first_healthy_s": rs[0]["healthy_s"],
                         "later_healthy_s_median": statistics.median(later),
                         "rss_ready_mib_median": statistics.median(x["rss_ready_mib"] for x in rs),
                         "peak_rss_32_streams_mib": rs[-1].get("peak_rss_32_streams_mib")}
        s = summary[name]
        rows.append([name, s["first_healthy_s"], s["later_healthy_s_median"],
                     s["rss_ready_mib_median"], s["peak_rss_32_streams_mib"]])
    hw = hardware()
    print(f"\n{hardware_line(hw)}; {a.rounds} starts each, alternating")
    print(markdown_table(["tree", "first start s", "later starts s (median)", "RSS when ready MiB",
                          "peak RSS, 32 streams MiB"], rows))
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "hardware": hw, "trees": trees,
                                   "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
