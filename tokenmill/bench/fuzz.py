"""`tokenmill bench fuzz`: a hostile client against a running server, and what it did to it.

Two phases, against a server it starts (or one at ``--base-url``):
1. **Schema fuzzing** with schemathesis: every operation of ``/openapi.json``, valid and
   invalid bodies, for ``--max-time`` seconds. Any 5xx, a crash, or a server that stops
   answering fails the run. The statuses seen are counted from schemathesis' HAR report.
2. **Heavy bodies**: ``--heavy-requests`` concurrent chat requests of ``--heavy-messages``
   empty messages each while /health is polled: the slowest /health answer shows whether the
   event loop stayed free while those bodies were parsed, rendered and refused.
Then the same greedy request as before the run must get the same answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from tokenmill.bench.procs import ServerProcess, free_port, start_server
from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json
from tokenmill.envs import child_environ

GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
          "ignore_eos": True}


@dataclass
class FuzzResult:
    """What one fuzzing run sent and saw."""

    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0
    schemathesis_exit: int = 0
    schemathesis_summary: str = ""
    # Requests that got no answer at all (status 0 in the HAR: a timeout or a dropped
    # connection), as "METHOD url body[:300]".
    unanswered: list[str] = field(default_factory=list)
    heavy_requests: int = 0
    heavy_statuses: dict[str, int] = field(default_factory=dict)
    health_polls: int = 0
    health_max_latency_s: float = 0.0
    same_answer_after: bool = False
    alive_after: bool = False

    @property
    def ok(self) -> bool:
        return (self.server_errors == 0 and self.alive_after and self.same_answer_after
                and self.schemathesis_exit == 0 and not self.unanswered)


def schemathesis_cli() -> list[str]:
    """The command that runs schemathesis (its ``st`` next to this Python, else on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "st")
    if os.path.exists(here):
        return [here]
    found = shutil.which("st")
    if found is None:
        raise ValueError("schemathesis is not installed: pip install schemathesis")
    return [found]


def run_schemathesis(base_url: str, max_time: int, workers: int, seed: int,
                     headers: dict[str, str]) -> tuple[int, str, Counter[str], list[str]]:
    """Fuzz every operation for ``max_time`` seconds; (exit code, summary, status counts,
    the requests that got no answer)."""
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        har = os.path.join(tmp, "run.har")
        cmd = [*schemathesis_cli(), "run", f"{base_url}/openapi.json", "--url", base_url,
               "--checks", "not_a_server_error", "--max-time", str(max_time),
               "--workers", str(workers), "--seed", str(seed), "--report", "har",
               "--report-har-path", har, "--report-dir", tmp, "--no-color", "--generation-database", "none",
               "--suppress-health-check", "all", "--request-timeout", "600"]
        for name, value in headers.items():
            cmd += ["-H", f"{name}: {value}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max_time + 600,
                              env=child_environ({"NO_COLOR": "1"}))
        statuses: Counter[str] = Counter()
        unanswered = []
        if os.path.exists(har):
            with open(har, encoding="utf-8") as f:
                for entry in json.load(f)["log"]["entries"]:
                    status = entry["response"]["status"]
                    statuses[str(status)] += 1
                    if not status:
                        req = entry["request"]
                        body = (req.get("postData") or {}).get("text", "")
                        unanswered.append(f"{req['method']} {req['url']} {body[:300]}")
    summary = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-60:])
    httpx.get(f"{base_url}/health", timeout=30)  # raises if the server is gone
    return proc.returncode, summary, statuses, unanswered


async def heavy_bodies(base_url: str, requests: int, messages: int,
                       headers: dict[str, str]) -> tuple[Counter[str], int, float]:
    """``requests`` concurrent chat requests of ``messages`` empty messages each, while
    /health is polled every 50 ms; (their statuses, polls, slowest /health in seconds)."""
    import httpx

    # Compact JSON: 120,000 empty messages stay under the default 4 MiB body limit.
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * messages,
                       "max_tokens": 1}, separators=(",", ":")).encode()
    json_headers = {**headers, "content-type": "application/json"}
    async with httpx.AsyncClient(timeout=600) as client:
        async def one() -> str:
            r = await client.post(f"{base_url}/v1/chat/completions", content=body,
                                  headers=json_headers)
            return str(r.status_code)

        tasks = [asyncio.ensure_future(one()) for _ in range(requests)]
        polls, slowest = 0, 0.0
        while not all(t.done() for t in tasks):
            t0 = time.perf_counter()
            await client.get(f"{base_url}/health", headers=headers)
            slowest = max(slowest, time.perf_counter() - t0)
            polls += 1
            await asyncio.sleep(0.05)
        return Counter(await asyncio.gather(*tasks)), polls, slowest


def greedy_answer(base_url: str, headers: dict[str, str]) -> str:
    import httpx

    r = httpx.post(f"{base_url}/v1/completions", json=GREEDY, headers=headers, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def run_fuzz(base_url: str, *, max_time: int = 120, workers: int = 2, seed: int = 0,
             heavy_requests: int = 8, heavy_messages: int = 120_000,
             api_key: str | None = None) -> FuzzResult:
    """Both phases against ``base_url``; see the module docstring."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    before = greedy_answer(base_url, headers)
    result = FuzzResult()
    code, summary, statuses, unanswered = run_schemathesis(base_url, max_time, workers, seed,
                                                           headers)
    result.schemathesis_exit, result.schemathesis_summary = code, summary
    result.unanswered = unanswered
    result.statuses = dict(sorted(statuses.items()))
    result.requests = sum(statuses.values())
    result.server_errors = sum(n for s, n in statuses.items() if s.startswith("5"))
    if heavy_requests:
        heavy, polls, slowest = asyncio.run(
            heavy_bodies(base_url, heavy_requests, heavy_messages, headers))
        result.heavy_requests = heavy_requests
        result.heavy_statuses = dict(sorted(heavy.items()))
        result.server_errors += sum(n for s, n in heavy.items() if s.startswith("5"))
        result.health_polls, result.health_max_latency_s = polls, round(slowest, 4)
    try:
        result.alive_after = httpx.get(f"{base_url}/health", timeout=30).status_code == 200
        result.same_answer_after = greedy_answer(base_url, headers) == before
    except httpx.HTTPError:
        result.alive_after = False
    return result


def add_fuzz_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench fuzz`."""
    p = subparsers.add_parser("fuzz", help="fuzz the server's OpenAPI schema and send it heavy "
                              "bodies; fails on any 5xx", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None,
                   help="a running server (default: start `tokenmill serve` on a free port)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--max-time", type=int, default=120, help="seconds of schema fuzzing")
    p.add_argument("--workers", type=int, default=2, help="concurrent fuzzing clients")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--heavy-requests", type=int, default=8, help="large hand-made requests sent beside the fuzzer")
    p.add_argument("--heavy-messages", type=int, default=120_000, help="chat messages in the largest of them")
    p.add_argument("--server-args", default="--max-model-len 256",
                   help="extra `tokenmill serve` options for the server it starts")
    p.add_argument("--result-file", default=None, help="write the result JSON here")
    p.set_defaults(func=cmd_fuzz)


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Run `tokenmill bench fuzz`; exit 1 if the server answered a 5xx, died or changed."""
    server: ServerProcess | None = None
    base_url = args.base_url
    if base_url is None:
        port = free_port()
        server = start_server([sys.executable, "-m", "tokenmill", "serve", "--port", str(port),
                               *args.server_args.split()], port)
        base_url = server.base_url
    try:
        result = run_fuzz(base_url.rstrip("/"), max_time=args.max_time, workers=args.workers,
                          seed=args.seed, heavy_requests=args.heavy_requests,
                          heavy_messages=args.heavy_messages, api_key=args.api_key)
    finally:
        if server is not None:
            server.stop()
    hw = hardware()
    print(result.schemathesis_summary)
    print(markdown_table(["status", "responses"], [[s, n] for s, n in result.statuses.items()]))
    print(markdown_table(
        ["fuzzed requests", "5xx", f"heavy bodies ({args.heavy_messages} messages)",
         "slowest /health", "same answer after"],
        [[result.requests, result.server_errors, json.dumps(result.heavy_statuses),
          f"{result.health_max_latency_s:.3f} s", result.same_answer_after]]))
    for line in result.unanswered:
        print(f"no answer: {line}")
    print(hardware_line(hw))
    if args.result_file:
        write_json(args.result_file, {"suite": "fuzz", "time": now_iso(), "hardware": hw,
                                      "args": vars(args) | {"func": None},
                                      "result": asdict(result), "ok": result.ok})
    return 0 if result.ok else 1
