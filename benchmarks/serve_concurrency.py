"""Aggregate output tokens/s of `tokenmill serve` at 1 stream and at N concurrent streams.

Starts a server on 127.0.0.1 (a free port), streams completions through the official openai
client, prints a table and writes JSON. Usage:

    python benchmarks/serve_concurrency.py --streams 16 --max-tokens 64 \
        --out benchmarks/results/serve-concurrency-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_stream(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int) -> int:
    stream = await client.completions.create(
        model=model, prompt=f"Story {i}: once upon a time", max_tokens=max_tokens,
        temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


async def run(url: str, model: str, streams: int, max_tokens: int) -> dict[str, float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    start = time.perf_counter()
    tokens = await asyncio.gather(*[one_stream(client, model, i, max_tokens)
                                    for i in range(streams)])
    elapsed = time.perf_counter() - start
    await client.close()
    return {"streams": streams, "output_tokens": sum(tokens), "seconds": elapsed,
            "output_tokens_per_s": sum(tokens) / elapsed}


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenmill", "-q", "serve", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/serve-concurrency-cpu.json")
    ap.add_argument("server_args", nargs="*", help="extra `tokenmill serve` arguments")
    args = ap.parse_args()
    port = free_port()
    proc = start_server(port, ["--max-model-len", "1024", "--max-num-seqs",
                               str(max(args.streams, 1)), *args.server_args])
    url = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(run(url, model, 1, 8))  # warm-up
        rows = [asyncio.run(run(url, model, n, args.max_tokens)) for n in (1, args.streams)]
    finally:
        proc.terminate()
        proc.wait(60)
    speedup = rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
    print(f"{'streams':>8} {'out tokens':>11} {'seconds':>8} {'out tok/s':>10}")
    for r in rows:
        print(f"{r['streams']:>8} {r['output_tokens']:>11} {r['seconds']:>8.2f} "
              f"{r['output_tokens_per_s']:>10.1f}")
    print(f"speed-up of {args.streams} streams over 1: {speedup:.2f}x")
    result = {"rows": rows, "speedup": speedup, "max_tokens": args.max_tokens,
              "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "command": " ".join(["python", *sys.argv])}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
