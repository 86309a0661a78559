"""Child processes of `bench compare`: servers on free loopback ports and one-shot JSON jobs."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.report import process_peak_rss_mib
from tokenmill.envs import child_environ

# Seconds a server gets to load its model and open its port.
SERVER_START_TIMEOUT_S = 300.0
# Seconds one measuring job may take before it is killed.
JOB_TIMEOUT_S = 3600.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, chars: int = 3000) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-chars:]


@dataclass
class ServerProcess:
    """A server started for a benchmark, its address and its log file."""

    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def peak_rss_mib(self) -> float | None:
        """The server's peak resident memory so far (read before stopping it)."""
        return process_peak_rss_mib(self.proc.pid)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after a minute; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(cmd: list[str], port: int, timeout: float = SERVER_START_TIMEOUT_S,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Start ``cmd`` (which must listen on ``port``) and wait until /v1/models answers 200.
    ``env``: its environment (default: ours)."""
    import httpx

    log = tempfile.NamedTemporaryFile("w", prefix="bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env)
    server = ServerProcess(proc, port, log.name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{_tail(log.name)}")
        try:
            if httpx.get(f"{server.base_url}/v1/models", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"{' '.join(cmd)} was not ready in {timeout:.0f} s:\n{_tail(log.name)}")


def run_json_job(cmd: list[str], result_file: str | None = None,
                 timeout: float = JOB_TIMEOUT_S,
                 extra_env: dict[str, str] | None = None,
                 base_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a measuring command; its JSON comes from ``result_file`` or stdout's last line.

    Its stderr (progress, logs) passes through to ours; a failure raises RuntimeError with the
    tail of its output. Its environment is ``base_env`` (default: ours) with ``extra_env``.
    """
    extra = {**(extra_env or {}), "TQDM_DISABLE": "1"}
    env = child_environ(extra) if base_env is None else {**base_env, **extra}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout,
                          env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{proc.stdout[-2000:]}")
    if result_file is not None:
        with open(result_file, encoding="utf-8") as f:
            return json.load(f)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines:
        raise RuntimeError(f"`{' '.join(cmd)}` printed no result")
    return json.loads(lines[-1])
