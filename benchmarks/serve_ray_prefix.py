"""Prefix-aware routing on Ray Serve: `tokenmill serve --replicas 2` with `--router prefix`
against `--router round_robin` on a prefix-heavy workload (many users, a few shared system
prompts), measured with `tokenmill bench serve`; the prefix-cache hit rate is read from the
replicas' /metrics (tokenmill:prefix_cache_hits / tokenmill:prefix_cache_queries, summed).

    OMP_NUM_THREADS=1 python benchmarks/serve_ray_prefix.py \
        [--num-prompts 96] [--systems 6] [--max-concurrency 4] [--routers prefix round_robin]

Prints a table and writes benchmarks/results/serve-ray-prefix-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"
TOPICS = ["a hardware shop", "a train company", "a city library", "a bakery", "a bank",
          "a cinema", "a hospital", "a university"]


def workload(path: Path, num: int, systems: int, seed: int) -> None:
    """``num`` requests over ``systems`` long system prompts, each with its own question."""
    rng = random.Random(seed)
    prompts = [f"You are the assistant of {TOPICS[i % len(TOPICS)]}. " + " ".join(
        f"Rule {j}: be precise about item {rng.randrange(10_000)}." for j in range(20))
        for i in range(systems)]
    with path.open("w") as f:
        for i in range(num):
            system = prompts[rng.randrange(systems)]
            question = f"User {i} asks about order {rng.randrange(10**6)}."
            f.write(json.dumps({"prompt": f"{system}\nUser: {question}\nAssistant:",
                                "output_len": 8}) + "\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become ready")


def hit_rate(url: str) -> tuple[float, dict[str, float]]:
    """The replicas' prefix-cache hit rate (all of them, and each's)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    sums: dict[str, dict[str, float]] = {}
    for kind in ("hits", "queries"):
        pattern = rf'^tokenmill:prefix_cache_{kind}_total\{{([^}}]*)\}} (\S+)'
        for labels, value in re.findall(pattern, text, re.M):
            replica = re.search(r'replica="([^"]+)"', labels).group(1)
            sums.setdefault(replica, {}).setdefault(kind, 0.0)
            sums[replica][kind] += float(value)
    per = {r: v.get("hits", 0) / v["queries"] for r, v in sums.items() if v.get("queries")}
    hits = sum(v.get("hits", 0) for v in sums.values())
    queries = sum(v.get("queries", 0) for v in sums.values())
    return (hits / queries if queries else 0.0), per


def run_router(router: str, data: Path, args: argparse.Namespace, workdir: Path) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}
    serve = [sys.executable, "-m", "tokenmill", "serve", "--replicas", "2", "--router", router,
             "--port", str(port), "--threads", "1", "--max-model-len", "512",
             "--num-kv-blocks", str(args.kv_blocks), "--replica-cpus", "1", "--no-webui"]
    log = (RESULTS / f"serve-ray-prefix-{router}.log").open("w")  # read on failure
    proc = subprocess.Popen(serve, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, proc)
        result_file = workdir / f"bench-{router}.json"
        bench = [sys.executable, "-m", "tokenmill", "bench", "serve", "--base-url", url,
                 "--dataset", str(data), "--num-prompts", str(args.num_prompts),
                 "--max-concurrency", str(args.max_concurrency), "--num-warmups", "0",
                 "--no-progress", "--result-file", str(result_file)]
        subprocess.run(bench, env=env, check=True)
        time.sleep(3)  # the replicas post their metrics every second
        rate, per = hit_rate(url)
        result = json.loads(result_file.read_text())
        return {"router": router, "prefix_cache_hit_rate": rate, "per_replica_hit_rate": per,
                "serve_command": " ".join(["tokenmill", *serve[3:]]),
                "bench_command": " ".join(["tokenmill", *bench[3:]]), "bench": result}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--systems", type=int, default=6)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=64,
                   help="KV blocks per replica: too few to hold every system prompt, enough "
                        "for half of them")
    p.add_argument("--routers", nargs="+", default=["prefix", "round_robin"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        data = workdir / "prefix-heavy.jsonl"
        workload(data, args.num_prompts, args.systems, args.seed)
        runs = [run_router(r, data, args, workdir) for r in args.routers]
    for router in args.routers:
        (RESULTS / f"serve-ray-prefix-{router}.log").unlink(missing_ok=True)
    print(f"{'router':<12} {'hit rate':>9} {'mean TTFT ms':>13} {'p99 TTFT ms':>12} "
          f"{'req/s':>7} {'done':>5}")
    for r in runs:
        b = r["bench"]
        print(f"{r['router']:<12} {r['prefix_cache_hit_rate']:>9.1%} {b['mean_ttft_ms']:>13.1f} "
              f"{b.get('p99_ttft_ms', float('nan')):>12.1f} {b['request_throughput']:>7.2f} "
              f"{b['completed']:>5}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "serve-ray-prefix-cpu.json"
    out.write_text(json.dumps({
        "benchmark": "serve_ray_prefix", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {platform.system()}",
        "command": " ".join(["python", *sys.argv]), "workload": vars(args), "runs": runs},
        indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
