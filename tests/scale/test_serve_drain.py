"""`tokenmill serve --replicas 1` as a command: it answers, and SIGTERM lets a stream already
running finish before the process exits 0 (the replicas drain, then the local Ray stops)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

# A local Ray cluster and engines: minutes on a small machine (in the default run all the same).
pytestmark = pytest.mark.slow

from tokenmill.serve_ray.messages import REPLICA_HEADER  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_a_running_stream() -> None:
    port = _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill", "serve", "--replicas", "1", "--port", str(port),
         "--threads", "1", "--max-model-len", "512", "--num-kv-blocks", "64", "--no-webui"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, "the server exited while starting"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True,
                    "stream": True, "temperature": 0}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                assert r.headers[REPLICA_HEADER]
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(300)
        proc.send_signal(signal.SIGTERM)
        reader.join(300)
        assert lines[-1] == "data: [DONE]"
        assert sum(1 for line in lines if '"text"' in line) >= 40
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_while_replicas_cannot_start_stops_the_server() -> None:
    """Replicas that ask for more CPUs than the local cluster has are never placed: SIGTERM
    while Ray Serve waits for them stops the server (and its local Ray) instead of hanging."""
    port = _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill", "serve", "--replicas", "1", "--port", str(port),
         "--replica-cpus", "512", "--threads", "1", "--no-webui"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Ray Serve's proxy listens while the application deploys (its answers wait for it).
        for _ in range(600):
            assert proc.poll() is None, "the server exited while starting"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except OSError:
                time.sleep(1)
        time.sleep(5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
