"""Does a low-priority flood delay a high-priority project's first token? One `tokenmill
serve` with two projects: "flood" keeps ``--flood`` streams of ``--flood-tokens`` tokens
running (each replaced as it ends), "urgent" sends ``--probes`` short requests one after
another and records their time to first token (TTFT). Three phases on the same server:
idle (no flood), flood at equal priority (FCFS), flood at priority 10 vs urgent at 0.

    OMP_NUM_THREADS=2 python benchmarks/tenancy_priority.py --max-num-seqs 4 --flood 12 \
        --result-file benchmarks/results/tenancy-priority-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

ADMIN = {"Authorization": "Bearer bench-admin"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: argparse.Namespace, data_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "--admin-key",
           "bench-admin", "--data-dir", data_dir, "--max-num-seqs", str(args.max_num_seqs),
           *([args.model] if args.model else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def project(url: str, name: str) -> tuple[str, str]:
    pid = httpx.post(f"{url}/v1/organization/projects", headers=ADMIN,
                     json={"name": name}).json()["id"]
    key = httpx.post(f"{url}/v1/organization/projects/{pid}/api_keys", headers=ADMIN,
                     json={"name": name}).json()["value"]
    return pid, key


async def ttft(http: httpx.AsyncClient, url: str, key: str, model: str, tokens: int) -> float:
    body = {"model": model, "prompt": "Write a story about a lighthouse keeper.",
            "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    t0 = time.perf_counter()
    first = None
    async with http.stream("POST", f"{url}/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    return first if first is not None else float("nan")


async def phase(args: argparse.Namespace, url: str, model: str, flood_key: str | None,
                urgent_key: str) -> list[float]:
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as http:
        async def flooder() -> None:
            while not stop.is_set():
                await ttft(http, url, flood_key, model, args.flood_tokens)

        tasks = [asyncio.create_task(flooder()) for _ in range(args.flood if flood_key else 0)]
        await asyncio.sleep(args.warmup if flood_key else 0)
        out = [await ttft(http, url, urgent_key, model, 4) for _ in range(args.probes)]
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_s": statistics.median(ordered),
            "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "max_s": ordered[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="MODEL for tokenmill serve (default: its own)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--flood", type=int, default=12, help="concurrent low-priority streams")
    p.add_argument("--flood-tokens", type=int, default=128)
    p.add_argument("--probes", type=int, default=8)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        proc, url = start(args, data_dir)
        try:
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            flood_pid, flood_key = project(url, "flood")
            _, urgent_key = project(url, "urgent")
            results: dict[str, Any] = {}
            results["idle"] = summary(asyncio.run(phase(args, url, model, None, urgent_key)))
            results["flood_equal_priority"] = summary(
                asyncio.run(phase(args, url, model, flood_key, urgent_key)))
            httpx.post(f"{url}/v1/organization/projects/{flood_pid}", headers=ADMIN,
                       json={"priority": 10})
            results["flood_low_priority"] = summary(
                asyncio.run(phase(args, url, model, flood_key, urgent_key)))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    report = {"config": vars(args), "cpus": os.cpu_count(), "ttft": results}
    print(json.dumps(report, indent=2))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
