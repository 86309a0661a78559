"""`tokenmill bench contention`: speed on a quiet machine and on one where a neighbour is busy.

A shared machine is never quiet. This measures, for each OpenMP thread policy asked for
(``--policy NAME=ENV``; by default tokenmill's own and libgomp's spinning default), the
single-stream decode speed (`bench latency`) and the 32-stream HTTP output throughput
(`tokenmill serve` + `bench serve`), first quiet, then while ``--busy-cores`` processes each
spin on one core (a fixed synthetic load: a tight loop pinned to the last cores). The result
is each number under load as a share of the quiet one: a policy that degrades with the cores
lost keeps about (cores - busy) / cores of it; one whose threads spin against each other and
the neighbour collapses by an order of magnitude.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tokenmill.bench.procs import ServerProcess, free_port, run_json_job, start_server
from tokenmill.bench.report import hardware, now_iso, write_json
from tokenmill.envs import THREAD_POLICY_VARS, child_environ

# The policies compared by default: tokenmill's default (what `tokenmill` sets when the user
# set neither variable), and libgomp's own default (spin 300,000 times at every barrier).
DEFAULT_POLICIES = ("tokenmill=", "libgomp-spin=GOMP_SPINCOUNT=300000")


def parse_policy(text: str) -> tuple[str, dict[str, str]]:
    """``NAME=VAR=VALUE[,VAR=VALUE...]`` (``NAME=`` alone: no variables)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--policy {text!r}: expected NAME=[VAR=VALUE,...]")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise ValueError(f"--policy {text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, env


# What chooses how idle threads wait: OpenMP's variables and the C++ kernels' own pool's
# (tokenmill/kernels/cpu/thread_pool.h).
POLICY_VARS = (*THREAD_POLICY_VARS, "TOKENMILL_SPIN_US", "TOKENMILL_THREAD_POOL")


def policy_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of a measured process: ours without any thread-policy variable, plus the
    policy's own."""
    return child_environ({**env, "TQDM_DISABLE": "1"}, drop=POLICY_VARS)


@contextmanager
def busy_cores(count: int) -> Iterator[list[int]]:
    """``count`` processes, each spinning on one of the last cores we may use."""
    cores = sorted(os.sched_getaffinity(0))
    chosen = cores[len(cores) - count:] if count else []
    procs = []
    for core in chosen:
        code = (f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                "x = 0\nwhile True:\n    x = (x + 1) % 1000003\n")
        procs.append(subprocess.Popen([sys.executable, "-c", code]))
    try:
        yield chosen
    finally:
        for p in procs:
            p.kill()
            p.wait()


def decode_speed(args: argparse.Namespace, env: dict[str, str]) -> float:
    """Single-stream decode tokens/s, median of the `bench latency` iterations."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "tokenmill", "-q", "bench", "latency",
               *_model_args(args), "--input-len", "32", "--output-len", str(args.output_len),
               "--num-iters", str(args.num_iters), "--num-warmups", "1",
               "--result-file", out.name]
        result = _run(cmd, env, out.name)
    return float(result["decode_tokens_per_s"])


def serve_throughput(args: argparse.Namespace, url: str) -> float:
    """Output tokens/s of `bench serve` with ``--streams`` concurrent streams."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "tokenmill", "-q", "bench", "serve", "--base-url", url,
               "--max-concurrency", str(args.streams),
               "--num-prompts", str(args.streams), "--input-len", "128",
               "--output-len", str(args.output_len), "--no-progress",
               "--result-file", out.name]
        result = run_json_job(cmd, out.name)
    return float(result["output_throughput"])


def _model_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model] if args.model else []


def _run(cmd: list[str], env: dict[str, str], result_file: str) -> dict[str, Any]:
    import json

    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}")
    with open(result_file, encoding="utf-8") as f:
        return json.load(f)


def measure_policy(args: argparse.Namespace, name: str, env: dict[str, str]) -> dict[str, Any]:
    """One policy: decode and serve throughput, quiet then loaded, ``--rounds`` times each."""
    penv = policy_env(env)
    row: dict[str, Any] = {"policy": name, "env": env}
    for what in ("decode", "serve"):
        for cond in ("quiet", "busy"):
            row[f"{what}_{cond}"] = []
    port = free_port()
    server = _start_server(args, port, penv)
    try:
        serve_throughput(args, server.base_url)  # warm-up: the first steps pay one-time costs
        for _ in range(args.rounds):
            for cond, count in (("quiet", 0), ("busy", args.busy_cores)):
                with busy_cores(count):
                    row[f"decode_{cond}"].append(decode_speed(args, penv))
                    row[f"serve_{cond}"].append(serve_throughput(args, server.base_url))
                print(f"{name} {cond}: decode {row[f'decode_{cond}'][-1]:.1f} tok/s, "
                      f"{args.streams} streams {row[f'serve_{cond}'][-1]:.1f} tok/s", flush=True)
    finally:
        server.stop()
    for what in ("decode", "serve"):
        quiet = statistics.median(row[f"{what}_quiet"])
        busy = statistics.median(row[f"{what}_busy"])
        row[f"{what}_busy_share"] = busy / quiet if quiet else None
    return row


def _start_server(args: argparse.Namespace, port: int, env: dict[str, str]) -> ServerProcess:
    """`tokenmill serve` under the policy's environment."""
    return start_server([sys.executable, "-m", "tokenmill", "-q", "serve",
                         *_model_args(args), "--port", str(port), "--max-num-seqs",
                         str(args.streams), "--no-monitor"], port, env=env)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.busy_cores < len(os.sched_getaffinity(0)):
        raise ValueError(f"--busy-cores must leave at least one core, got {args.busy_cores}")
    policies = [parse_policy(p) for p in (args.policy or DEFAULT_POLICIES)]
    rows = [measure_policy(args, name, env) for name, env in policies]
    cores = len(os.sched_getaffinity(0))
    print(f"\n{'policy':<16}{'decode quiet':>14}{'busy':>9}{'share':>8}"
          f"{'serve quiet':>14}{'busy':>9}{'share':>8}")
    for r in rows:
        print(f"{r['policy']:<16}{statistics.median(r['decode_quiet']):>14.1f}"
              f"{statistics.median(r['decode_busy']):>9.1f}{r['decode_busy_share']:>8.0%}"
              f"{statistics.median(r['serve_quiet']):>14.1f}"
              f"{statistics.median(r['serve_busy']):>9.1f}{r['serve_busy_share']:>8.0%}")
    print(f"(cores {cores}, busy {args.busy_cores}: proportional share "
          f"{(cores - args.busy_cores) / cores:.0%})")
    if args.result_file:
        write_json(args.result_file, {
            "benchmark": "contention", "date": now_iso(), "hardware": hardware(),
            "model": args.model, "busy_cores": args.busy_cores, "streams": args.streams,
            "output_len": args.output_len, "rounds": args.rounds, "policies": rows,
            "command": "tokenmill bench contention " + " ".join(sys.argv[3:])})
    return 0


def add_contention_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench contention`."""
    p = subparsers.add_parser("contention", help=__doc__.splitlines()[0].split(": ", 1)[1],
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="model file or folder (default: the embedded one)")
    p.add_argument("--policy", action="append", default=None, metavar="NAME=[VAR=VALUE,...]",
                   help="an OpenMP thread policy to measure, repeatable (default: "
                        + " and ".join(DEFAULT_POLICIES) + ")")
    p.add_argument("--busy-cores", type=int, default=1,
                   help="cores kept busy by the synthetic neighbour (default: 1)")
    p.add_argument("--streams", type=int, default=32, help="HTTP streams (default: 32)")
    p.add_argument("--output-len", type=int, default=32,
                   help="output tokens per request (default: 32)")
    p.add_argument("--num-iters", type=int, default=3,
                   help="decode iterations per measurement (default: 3)")
    p.add_argument("--rounds", type=int, default=2,
                   help="quiet/busy rounds per policy (default: 2)")
    p.add_argument("--result-file", default=None, help="write the JSON result here")
    p.set_defaults(func=run)
