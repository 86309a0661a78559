"""How long one large text input stalls the whole server: /health is polled (one request at a
time) while `tokenmill serve --task embed` (all-MiniLM-L6-v2) takes

  ingest      a FILE_MB text file attached to a vector store (polled for --window seconds
              from the attach, covering its tokenization; the store is then deleted)
  embeddings  one EMBED_MB input to POST /v1/embeddings
  api_embed   the same input to Ollama's POST /api/embed
  search      the same text as a vector-store search query

and the longest /health answer is reported (before the fix: the length of one tokenizer call
on the whole text, which holds the GIL). Which tokenmill runs is whatever ``python -m
tokenmill`` imports (set PYTHONPATH to measure another tree).

    python benchmarks/retrieval_stalls.py --label after [--file-mb 20] [--embed-mb 3.9]
        [--window 60] [--result-file benchmarks/results/retrieval-stalls-cpu.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

LINE = "The lighthouse keeper logs every passing ship, the gulls and the tide's height.\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(os.path.join(data_dir, "server.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill", "serve", "--task", "embed", "--port", str(port),
         "--data-dir", data_dir, "--max-model-len", "512", "--kv-cache-memory",
         str(128 << 20)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("the server did not start")


def poll_health(url: str, stop: threading.Event, out: list[float], failed: list[str]) -> None:
    """/health answers' latencies (seconds), one request at a time, until ``stop``. A
    failed poll counts with its latency too (a server stalled past its keep-alive timeout
    resets the connection a request was just sent on)."""
    with httpx.Client(timeout=600) as http:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                http.get(f"{url}/health").raise_for_status()
            except httpx.HTTPError as e:
                failed.append(type(e).__name__)
            out.append(time.perf_counter() - t)
            time.sleep(0.02)


def while_polling(url: str, action: Callable[[], Any]) -> dict[str, Any]:
    """Run ``action`` while /health is polled; its result, its time and the polls'."""
    latencies: list[float] = []
    failed: list[str] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_health, args=(url, stop, latencies, failed))
    poller.start()
    time.sleep(0.5)
    t = time.perf_counter()
    result = action()
    elapsed = time.perf_counter() - t
    stop.set()
    poller.join()
    return {"result": result, "action_s": round(elapsed, 3), "polls": len(latencies),
            "failed_polls": len(failed),
            "health_max_s": round(max(latencies), 3),
            "health_p50_s": round(sorted(latencies)[len(latencies) // 2], 4)}


def ingest(url: str, file_mb: float, window: float) -> Any:
    text = LINE * int(file_mb * (1 << 20) / len(LINE))
    with httpx.Client(base_url=url, timeout=600) as http:
        f = http.post("/v1/files", data={"purpose": "assistants"},
                      files={"file": ("big.txt", io.BytesIO(text.encode()))}).json()
        store = http.post("/v1/vector_stores", json={"name": "big"}).json()
        http.post(f"/v1/vector_stores/{store['id']}/files", json={"file_id": f["id"]})
        time.sleep(window)
        status = http.get(f"/v1/vector_stores/{store['id']}/files/{f['id']}").json()
        http.delete(f"/v1/vector_stores/{store['id']}")
        http.delete(f"/v1/files/{f['id']}")
    return status.get("status")


def post(url: str, path: str, body: dict[str, Any]) -> Callable[[], Any]:
    def call() -> Any:
        return httpx.post(f"{url}{path}", json=body, timeout=600).status_code
    return call


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tokenmill-stalls-") as data_dir:
        proc, url = start_server(data_dir)
        try:
            big = LINE * int(args.embed_mb * (1 << 20) / len(LINE))
            store = httpx.post(f"{url}/v1/vector_stores", json={"name": "q"}).json()["id"]
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            cases = {
                "ingest": lambda: ingest(url, args.file_mb, args.window),
                "embeddings": post(url, "/v1/embeddings", {"input": big}),
                "api_embed": post(url, "/api/embed", {"model": model, "input": big}),
                "search": post(url, f"/v1/vector_stores/{store}/search", {"query": big}),
            }
            return {name: while_polling(url, action) for name, action in cases.items()}
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True, help="the name of this run (before, after...)")
    p.add_argument("--file-mb", type=float, default=20.0)
    p.add_argument("--embed-mb", type=float, default=3.9)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--result-file", default="benchmarks/results/retrieval-stalls-cpu.json")
    args = p.parse_args()
    cases = run(args)
    print(f"{args.label}: /health polled while the server takes one large input")
    print(f"{'case':<12}{'answer':>12}{'request s':>11}{'polls':>7}{'failed':>8}"
          f"{'health max s':>14}{'health p50 s':>14}")
    for name, c in cases.items():
        print(f"{name:<12}{c['result']!s:>12}{c['action_s']:>11.2f}{c['polls']:>7}"
              f"{c['failed_polls']:>8}{c['health_max_s']:>14.3f}{c['health_p50_s']:>14.4f}")
    results: dict[str, Any] = {}
    if os.path.exists(args.result_file):
        with open(args.result_file) as f:
            results = json.load(f)
    results[args.label] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "file_mb": args.file_mb, "embed_mb": args.embed_mb, "window_s": args.window,
        "cases": cases}
    os.makedirs(os.path.dirname(args.result_file) or ".", exist_ok=True)
    with open(args.result_file, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
