"""Start and drive real `tokenmill serve` processes on 127.0.0.1 (free ports) in tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# Small context and KV cache: fast start-up, plenty for short test prompts.
BASE_ARGS = ["--max-model-len", "512", "--kv-cache-memory", str(128 << 20)]
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One server process and how to reach it."""

    proc: subprocess.Popen
    port: int
    log_path: str
    model: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metrics(self, model: str | None = None) -> dict[str, float]:
        """Every sample of /metrics by name (labels other than finished_reason dropped; the
        samples of several models added up), or of one model only."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if model is not None and s.labels.get("model_name") != model:
                    continue
                reason = s.labels.get("finished_reason")
                key = f"{s.name}[{reason}]" if reason else s.name
                out[key] = out.get(key, 0.0) + s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(*args: str, env: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None) -> Server:
    """Start `tokenmill serve` and wait until /health answers 200."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="tokenmill-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), *BASE_ARGS, *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    server = Server(proc, port, log.name)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{server.log()}")
        try:
            r = httpx.get(f"{server.url}/health", timeout=2)
            if r.status_code == 200:
                models = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=5)
                server.model = models.json()["data"][0]["id"]
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    server.stop(signal.SIGKILL)
    pytest.fail(f"the server did not become healthy in {START_TIMEOUT_S} s:\n{server.log()}")


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def idle(server: Server) -> bool:
    """Nothing running or waiting, and every KV block free."""
    m = server.metrics()
    return (m["tokenmill:num_requests_running"] == 0
            and m["tokenmill:num_requests_waiting"] == 0
            and m["tokenmill:kv_cache_usage_perc"] == 0)


async def leave_mid_stream(server: Server, chunks: int = 2) -> None:
    """A client that reads ``chunks`` chunks of a long completion stream and hangs up."""
    body = {"model": server.model, "prompt": "A long story:", "max_tokens": 200,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http, http.stream(
            "POST", f"{server.url}/v1/completions", json=body) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            seen += line.startswith("data:")
            if seen >= chunks:
                break
