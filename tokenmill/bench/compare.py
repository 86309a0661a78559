"""`tokenmill bench compare`: tokenmill, llama.cpp and transformers on one workload, in one run.

One after another on the same machine, the same GGUF file and the same thread count:

- single stream (`bench latency` / llama-cpp-python's `Llama` / transformers' `generate`):
  prefill of a 500-token prompt, then decode of 128 tokens; TTFT, prefill and decode tok/s;
- offline batch of 32 x 128 output tokens (`bench throughput` / transformers' `generate`);
- concurrency sweep through each HTTP server with the `bench serve` load generator: 1, 4, 16,
  32 streams of 128 output tokens; `tokenmill serve` against llama.cpp's own `llama-server`
  restarted at each level with as many slots (`-np`) as streams and their contexts
  (continuous batching; built by benchmarks/setup_llama_server.sh), or, without that binary,
  llama-cpp-python's server (one request at a time);
- peak resident memory of every process.

The peers run as subprocesses of the Python in ``--peers-python`` (the virtual environment of
benchmarks/setup_peers.sh), so they never touch tokenmill's environment; a peer that is not
installed is reported as skipped. Writes ``<out-dir>/<name>-<date>.json``, ``.md`` (ratios
tokenmill / peer) and ``.png`` (throughput and latency percentiles vs concurrency).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill import envs
from tokenmill.bench.codec import LocalCodec
from tokenmill.bench.datasets import SampleRequest, random_requests, write_jsonl
from tokenmill.bench.procs import free_port, run_json_job, start_server
from tokenmill.bench.report import hardware, now_iso, write_json
from tokenmill.bench.serve import LoadSpec, benchmark, quiet_http_logs, server_model
from tokenmill.core.kv_cache import blocks_for_tokens
from tokenmill.envs import foreign_environ
from tokenmill.utils import cdiv

SYSTEMS = ("tokenmill", "llama.cpp", "transformers")
PEERS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers.py")
# Context of every engine here (llama.cpp's n_ctx too): the longest workload is 500 + 128.
MAX_MODEL_LEN = 1024
# Where benchmarks/setup_llama_server.sh (run by setup_peers.sh) builds llama-server.
DEFAULT_LLAMA_SERVER = os.path.join("benchmarks", ".peers", "llama.cpp-build", "bin",
                                    "llama-server")
# tokenmill's KV cache block size; its caches are sized to the workload (below), not to a share
# of free memory, so that peak memory does not depend on what else the machine holds.
BLOCK_SIZE = 16


@dataclass
class CompareConfig:
    """The workloads and who runs them."""

    model: str
    threads: int
    peers_python: str
    levels: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    serve_input_len: int = 128
    output_len: int = 128
    prompts_per_stream: int = 2  # each level sends max(4, this x streams) requests
    latency_input_len: int = 500
    num_iters: int = 3
    num_warmups: int = 1
    batch_size: int = 32
    seed: int = 0
    systems: tuple[str, ...] = SYSTEMS
    # Extra engine options for every tokenmill process, e.g. ["--quantization", "int4"].
    tokenmill_args: list[str] = field(default_factory=list)
    # llama.cpp's `llama-server` binary: the multi-stream peer (None: llama-cpp-python's).
    llama_server: str | None = None


@dataclass
class Workloads:
    """The same prompts for every system, saved as JSONL files for the subprocesses."""

    latency_path: str
    batch_path: str
    serve: list[SampleRequest]


def prepare_workloads(cfg: CompareConfig, folder: str) -> Workloads:
    """Random prompts of exact lengths in the model's tokenizer (all peers read the same GGUF)."""
    codec = LocalCodec(cfg.model)

    def as_ids(reqs: list[SampleRequest]) -> list[SampleRequest]:
        return [SampleRequest(codec.encode(str(r.prompt)), r.prompt_len, r.output_len)
                for r in reqs]

    latency = as_ids(random_requests(codec, cfg.num_warmups + cfg.num_iters,
                                     cfg.latency_input_len, cfg.output_len, cfg.seed))
    batch = as_ids(random_requests(codec, cfg.batch_size, cfg.serve_input_len, cfg.output_len,
                                   cfg.seed + 1))
    # Every level its own prompts: a server kept up across the levels (tokenmill's) must not
    # find the next level's prompts in its prefix cache (llama-server restarts per level).
    serve = random_requests(codec, sum(level_requests(cfg, c) for c in cfg.levels),
                            cfg.serve_input_len, cfg.output_len, cfg.seed + 2)
    wl = Workloads(os.path.join(folder, "latency.jsonl"), os.path.join(folder, "batch.jsonl"),
                   serve)
    write_jsonl(wl.latency_path, latency)
    write_jsonl(wl.batch_path, batch)
    write_jsonl(os.path.join(folder, "serve.jsonl"), serve)
    return wl


def compact(result: dict[str, Any]) -> dict[str, Any]:
    """A `bench serve` result without its per-request lists."""
    drop = {"input_lens", "output_lens", "ttfts", "itls", "e2els", "errors"}
    errors = [e for e in result.get("errors", []) if e]
    return {**{k: v for k, v in result.items() if k not in drop},
            "first_error": errors[0] if errors else None}


def sweep(cmd: list[str], port: int, cfg: CompareConfig, wl: Workloads,
          min_tokens: bool = False, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start a server, run the load generator at every concurrency level, stop it."""
    server = start_server(cmd, port, env=env)
    try:
        levels = {str(c): load_level(server.base_url, c, cfg, wl, min_tokens)
                  for c in cfg.levels}
        return {"command": " ".join(cmd), "levels": levels,
                "peak_rss_mib": server.peak_rss_mib()}
    finally:
        server.stop()


def level_requests(cfg: CompareConfig, streams: int) -> int:
    """How many requests the level of ``streams`` concurrent streams sends."""
    return max(4, cfg.prompts_per_stream * streams)


def load_level(url: str, streams: int, cfg: CompareConfig, wl: Workloads,
               min_tokens: bool) -> dict[str, Any]:
    """The load generator at one concurrency level, on that level's own prompts."""
    n = level_requests(cfg, streams)
    start = sum(level_requests(cfg, c) for c in cfg.levels[:cfg.levels.index(streams)])
    print(f"  {streams} concurrent streams, {n} requests", file=sys.stderr)
    spec = LoadSpec(base_url=url, model=server_model(url, {}), requests=wl.serve[start:start + n],
                    max_concurrency=streams, seed=cfg.seed, min_tokens=min_tokens)
    return compact(benchmark(spec, percentiles=(90.0, 99.0)))


def sweep_llama_server(cfg: CompareConfig, wl: Workloads) -> dict[str, Any]:
    """`llama-server` started anew for each level with one slot per stream, each slot with
    the context a request needs (as tokenmill's KV cache is sized); the peak memory is the
    largest level's."""
    assert cfg.llama_server is not None
    per_slot = cdiv(cfg.serve_input_len + cfg.output_len, BLOCK_SIZE) * BLOCK_SIZE
    levels: dict[str, Any] = {}
    commands, rss = [], []
    for c in cfg.levels:
        port = free_port()
        cmd = [cfg.llama_server, "--model", cfg.model, "--host", "127.0.0.1", "--port",
               str(port), "--threads", str(cfg.threads), "--threads-batch", str(cfg.threads),
               "--parallel", str(c), "--ctx-size", str(c * per_slot), "--cont-batching",
               "--no-webui"]
        server = start_server(cmd, port, env=foreign_environ())
        try:
            # llama-server honours ignore_eos, so outputs have the asked length.
            levels[str(c)] = load_level(server.base_url, c, cfg, wl, min_tokens=False)
            rss.append(server.peak_rss_mib())
        finally:
            server.stop()
        commands.append(" ".join(cmd))
    return {"command": commands[-1], "commands": commands, "levels": levels,
            "peak_rss_mib": rss[-1] if rss else None, "server": "llama-server"}


def run_tokenmill(cfg: CompareConfig, wl: Workloads, folder: str) -> dict[str, Any]:
    """`bench latency`, `bench throughput` and `serve` + the load generator, each its own process."""
    engine = ["--model", cfg.model, "--threads", str(cfg.threads),
              "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
              *cfg.tokenmill_args]
    # One context of MAX_MODEL_LEN for the single stream (as llama.cpp's n_ctx); every stream's
    # prompt + output, plus a block each for rounding, for the batch and the server.
    single = ["--num-kv-blocks", str(blocks_for_tokens(MAX_MODEL_LEN, BLOCK_SIZE))]
    streams = max(cfg.batch_size, *cfg.levels)
    per_stream = blocks_for_tokens(cfg.serve_input_len + cfg.output_len, BLOCK_SIZE)
    many = ["--num-kv-blocks", str(streams * per_stream)]
    tm = [sys.executable, "-m", "tokenmill", "-q"]
    out: dict[str, Any] = {}
    lat_file, tp_file = os.path.join(folder, "tm-latency.json"), os.path.join(folder, "tm-tp.json")
    print("tokenmill: single stream", file=sys.stderr)
    out["latency"] = run_json_job(
        [*tm, "bench", "latency", *engine, *single, "--dataset", wl.latency_path, "--num-iters",
         str(cfg.num_iters), "--num-warmups", str(cfg.num_warmups), "--result-file", lat_file],
        lat_file)
    print(f"tokenmill: offline batch of {cfg.batch_size}", file=sys.stderr)
    out["batch"] = run_json_job(
        [*tm, "bench", "throughput", *engine, *many, "--dataset", wl.batch_path, "--num-prompts",
         str(cfg.batch_size), "--max-num-seqs", str(cfg.batch_size), "--no-progress",
         "--result-file", tp_file], tp_file)
    print("tokenmill: HTTP server", file=sys.stderr)
    port = free_port()
    out["serve"] = sweep([*tm, "serve", "--port", str(port), *engine, *many,
                          "--max-num-seqs", str(max(cfg.levels))], port, cfg, wl)
    out["version"] = _tokenmill_version()
    return out


def run_llama(cfg: CompareConfig, wl: Workloads, folder: str) -> dict[str, Any]:
    """llama-cpp-python's `Llama` for the single stream; for the sweep `llama-server` when its
    binary is there, else llama-cpp-python's server."""
    py, t = cfg.peers_python, str(cfg.threads)
    print("llama.cpp: single stream", file=sys.stderr)
    out = {"latency": run_json_job([py, PEERS_SCRIPT, "llama-latency", "--model", cfg.model,
                                    "--threads", t, "--workload", wl.latency_path,
                                    "--num-warmups", str(cfg.num_warmups)],
                                   base_env=foreign_environ())}
    out["version"] = out["latency"].get("version")
    if cfg.llama_server is not None:
        print("llama.cpp: HTTP server (llama-server, -np = streams)", file=sys.stderr)
        out["serve"] = sweep_llama_server(cfg, wl)
        return out
    print("llama.cpp: HTTP server (llama_cpp.server)", file=sys.stderr)
    port = free_port()
    # The server serves one request at a time; interrupt_requests off lets a queued request
    # wait for the running one instead of cutting it short.
    cmd = [py, "-m", "llama_cpp.server", "--model", cfg.model, "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", t, "--n_threads_batch", t,
           "--n_ctx", str(MAX_MODEL_LEN), "--interrupt_requests", "False"]
    # It has no ignore_eos (nor usage in streams: its chunks, one token each, are counted).
    out["serve"] = sweep(cmd, port, cfg, wl, min_tokens=True, env=foreign_environ())
    return out


def run_transformers(cfg: CompareConfig, wl: Workloads, folder: str) -> dict[str, Any]:
    """transformers' `generate`: one sequence, then the batch of 32, each its own process."""
    base = [cfg.peers_python, PEERS_SCRIPT, "--model", cfg.model, "--threads", str(cfg.threads),
            "--num-warmups", str(cfg.num_warmups)]
    print("transformers: single stream", file=sys.stderr)
    env = foreign_environ()
    out = {"latency": run_json_job([*base, "hf-latency", "--workload", wl.latency_path],
                                   base_env=env)}
    print(f"transformers: batch of {cfg.batch_size}", file=sys.stderr)
    out["batch"] = run_json_job([*base, "hf-batch", "--workload", wl.batch_path], base_env=env)
    out["version"] = out["latency"].get("version")
    return out


def peer_versions(python: str) -> dict[str, Any]:
    """What the peers' Python can import; an empty dict when there is no such Python."""
    if not os.path.exists(python):
        return {}
    try:
        return run_json_job([python, PEERS_SCRIPT, "check"], timeout=300)
    except (RuntimeError, OSError, ValueError) as e:
        return {"error": str(e)}


def skip_reason(system: str, versions: dict[str, Any], python: str) -> str | None:
    """Why a peer cannot run here, or None when it can."""
    if system == "tokenmill":
        return None
    if not versions:
        return f"no peers environment at {python}: run `bash benchmarks/setup_peers.sh`"
    module = "llama_cpp" if system == "llama.cpp" else "transformers"
    if not versions.get(module):
        return f"{module} is not importable by {python}: {versions.get(f'{module}_error', '')}"
    return None


def run_compare(cfg: CompareConfig) -> dict[str, Any]:
    """Every system in turn; a missing peer is skipped, a failing one recorded, never fatal."""
    runners: dict[str, Callable[[CompareConfig, Workloads, str], dict[str, Any]]] = {
        "tokenmill": run_tokenmill, "llama.cpp": run_llama, "transformers": run_transformers}
    versions = peer_versions(cfg.peers_python)
    # Other work on the machine skews every number: the load averages say whether there was any.
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    print("memory read bandwidth and the model's bytes per decode token", file=sys.stderr)
    # Its own process: the parent's resident buffer would be inherited by every fork after it.
    limit = run_json_job([sys.executable, "-m", "tokenmill.bench.roofline", "--model", cfg.model,
                          "--threads", str(cfg.threads)])
    with tempfile.TemporaryDirectory(prefix="tokenmill-compare-") as folder:
        wl = prepare_workloads(cfg, folder)
        for system in cfg.systems:
            reason = skip_reason(system, versions, cfg.peers_python)
            if reason:
                print(f"{system}: skipped ({reason})", file=sys.stderr)
                results[system] = {"skipped": reason}
                continue
            try:
                results[system] = runners[system](cfg, wl, folder)
            except (RuntimeError, OSError, ValueError) as e:
                print(f"{system}: failed: {e}", file=sys.stderr)
                results[system] = {"error": str(e)}
    return {"date": now_iso(), "hardware": hardware(), "config": asdict(cfg),
            "peer_versions": versions, "roofline": limit, "load_average_before": load_before,
            "load_average_after": os.getloadavg(), "systems": results,
            # The peers' OpenMP wait policy: their own default (None) unless the user set one.
            "peer_omp_wait_policy": foreign_environ().get("OMP_WAIT_POLICY"),
            "tokenmill_omp_wait_policy": envs.OMP_WAIT_POLICY}


def _tokenmill_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenmill")
    except PackageNotFoundError:
        return "unknown"


def add_compare_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench compare`."""
    p = subparsers.add_parser("compare", help="tokenmill vs llama.cpp vs transformers, one run",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads (default: every core this process may use)")
    p.add_argument("--peers-python", default=os.path.join("benchmarks", ".venv-peers", "bin",
                                                          "python"),
                   help="the Python that has the peers (benchmarks/setup_peers.sh makes it)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER, metavar="PATH",
                   help="llama.cpp's llama-server binary, the multi-stream peer (default: "
                        "where benchmarks/setup_llama_server.sh builds it; if missing, "
                        "llama-cpp-python's server is used)")
    p.add_argument("--tokenmill-args", default="",
                   help="extra engine options for tokenmill, as one string: "
                        "--tokenmill-args='--quantization int4'")
    p.add_argument("--concurrency", default="1,4,16,32", help="server streams per level")
    p.add_argument("--prompts-per-stream", type=int, default=2, help="requests per concurrent stream at each level")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (batch, server)")
    p.add_argument("--latency-input-len", type=int, default=500, help="prompt tokens of the single-stream run")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--batch-size", type=int, default=32, help="requests in the offline batch")
    p.add_argument("--num-iters", type=int, default=3, help="timed iterations")
    p.add_argument("--num-warmups", type=int, default=1, help="untimed iterations first")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--out-dir", default=os.path.join("benchmarks", "results"), help="folder for the JSON, markdown and PNG")
    p.add_argument("--name", default="cpu", help="file name prefix: NAME-DATE.json/.md/.png")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    """Run `tokenmill bench compare` and write its JSON, markdown and PNG."""
    from tokenmill.bench.compare_report import markdown_report, plot
    from tokenmill.model_loader.gguf import embedded_model_path

    quiet_http_logs()
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    cfg = CompareConfig(
        model=os.path.abspath(args.model or embedded_model_path()), threads=args.threads,
        peers_python=args.peers_python, levels=[int(c) for c in args.concurrency.split(",")],
        serve_input_len=args.input_len, output_len=args.output_len,
        prompts_per_stream=args.prompts_per_stream, latency_input_len=args.latency_input_len,
        num_iters=args.num_iters, num_warmups=args.num_warmups, batch_size=args.batch_size,
        seed=args.seed, systems=systems, tokenmill_args=shlex.split(args.tokenmill_args),
        llama_server=args.llama_server if os.access(args.llama_server, os.X_OK) else None)
    if cfg.llama_server is None:
        print(f"no llama-server at {args.llama_server}: the multi-stream peer is "
              "llama-cpp-python's server (one request at a time)", file=sys.stderr)
    result = run_compare(cfg)
    result["command"] = " ".join(["tokenmill", *sys.argv[1:]])
    stem = os.path.join(args.out_dir, f"{args.name}-{dt.date.today().isoformat()}")
    write_json(stem + ".json", result)
    md = markdown_report(result)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(md + "\n")
    png = plot(result, stem + ".png")
    print(md)
    print(f"\nwrote {stem}.json, {stem}.md" + (f", {png}" if png else ""), file=sys.stderr)
    return 0
