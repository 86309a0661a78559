"""Prefix-aware routing on Ray Serve: `tokenmill serve --replicas 2` with `--router prefix`
against `--router round_robin` on a prefix-heavy workload (many users, a few shared system
prompts), measured with `tokenmill bench serve`; the prefix-cache hit rate is read from the
replicas' /metrics (tokenmill:prefix_cache_hits / tokenmill:prefix_cache_queries, summed).

    OMP_NUM_THREADS=1 python benchmarks/serve_ray_prefix.py \
        [--num-prompts 96] [--systems 6] [--max-concurrency 4] [--routers prefix round_robin]
        [--rounds 2]

Each router runs ``--rounds`` times, alternated (prefix, round_robin, round_robin, prefix, ...),
each run on a fresh `tokenmill serve --replicas 2` (one OMP thread per replica). Prints each
round and a table of the means, and writes benchmarks/results/serve-ray-prefix-<device>.json.
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

from tokenmill.model_loader.gguf import embedded_model_path

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
    # The embedded chat model alone (without --model the embedding model would get replicas
    # of its own, more than two cores hold).
    serve = [sys.executable, "-m", "tokenmill", "serve", "--model", embedded_model_path(),
             "--replicas", "2", "--router", router, "--port", str(port), "--threads", "1", "--max-model-len", "512",
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


def cpu_model() -> str:
    """lscpu's model name (the platform's processor name when lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    found = re.search(r"^Model name:\s*(.+)$", out, re.M)
    return found.group(1).strip() if found else platform.machine()


def summary(runs: list[dict], router: str) -> dict:
    """The mean over the rounds of one router."""
    mine = [r for r in runs if r["router"] == router]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return {"router": router, "rounds": len(mine),
            "prefix_cache_hit_rate": mean([r["prefix_cache_hit_rate"] for r in mine]),
            "mean_ttft_ms": mean([r["bench"]["mean_ttft_ms"] for r in mine]),
            "median_ttft_ms": mean([r["bench"]["median_ttft_ms"] for r in mine]),
            "p99_ttft_ms": mean([r["bench"]["p99_ttft_ms"] for r in mine]),
            "request_throughput": mean([r["bench"]["request_throughput"] for r in mine]),
            "completed": sum(r["bench"]["completed"] for r in mine)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--systems", type=int, default=6)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=64,
                   help="KV blocks per replica: too few to hold every system prompt, enough "
                        "for half of them")
    p.add_argument("--routers", nargs="+", default=["prefix", "round_robin"])
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each router, alternated (A B B A ...) so that drift of a "
                        "shared machine falls on both")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    order = [r for i in range(args.rounds)
             for r in (args.routers if i % 2 == 0 else args.routers[::-1])]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        data = workdir / "prefix-heavy.jsonl"
        workload(data, args.num_prompts, args.systems, args.seed)
        runs = []
        for i, router in enumerate(order):
            run = run_router(router, data, args, workdir)
            runs.append({"round": i // len(args.routers) + 1, **run})
            print(f"round {runs[-1]['round']} {router}: hit rate "
                  f"{run['prefix_cache_hit_rate']:.1%}, mean TTFT "
                  f"{run['bench']['mean_ttft_ms']:.1f} ms", flush=True)
    for router in args.routers:
        (RESULTS / f"serve-ray-prefix-{router}.log").unlink(missing_ok=True)
    means = [summary(runs, r) for r in args.routers]
    print(f"{'router':<12} {'rounds':>6} {'hit rate':>9} {'mean TTFT ms':>13} "
          f"{'median TTFT ms':>15} {'p99 TTFT ms':>12} {'req/s':>7} {'done':>5}")
    for m in means:
        print(f"{m['router']:<12} {m['rounds']:>6} {m['prefix_cache_hit_rate']:>9.1%} "
              f"{m['mean_ttft_ms']:>13.1f} {m['median_ttft_ms']:>15.1f} "
              f"{m['p99_ttft_ms']:>12.1f} {m['request_throughput']:>7.2f} "
              f"{m['completed']:>5}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "serve-ray-prefix-cpu.json"
    out.write_text(json.dumps({
        "benchmark": "serve_ray_prefix", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_model(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {platform.system()}",
        "command": " ".join(["OMP_NUM_THREADS=1", "python", *sys.argv]),
        "workload": vars(args), "order": order, "summary": means, "runs": runs},
        indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
