"""`tokenmill bench structured`: what JSON-schema constrained decoding costs, and how often its
outputs are valid, beside llama.cpp's server.

1. Overhead, in this process on one engine: the schema set's prompts with their schemas vs the
   same prompts unconstrained with the same output lengths, at batch 1 and batch 32, alternated
   over ``--rounds`` (tokenmill/bench/structured_overhead.py).
2. Validity, over HTTP: every schema of the set through `tokenmill serve` and, with
   ``--llama-server PATH``, through llama.cpp's `llama-server`; each output parsed with
   ``json.loads`` and validated with `jsonschema` (tokenmill/bench/structured_validity.py).

Prints tables, writes the JSON of ``--result-file``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tokenmill.bench.report import hardware, markdown_table, now_iso, write_json
from tokenmill.bench.structured_set import SCHEMAS_PATH, load_schema_set

DEFAULT_MAX_TOKENS = 384


def add_structured_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench structured`."""
    from tokenmill.engine.args import add_engine_args

    p = subparsers.add_parser("structured", help="JSON-schema decoding: overhead and validity, "
                              "vs llama-server", description=__doc__.splitlines()[0])
    add_engine_args(p)
    g = p.add_argument_group("structured")
    g.add_argument("--schemas", default=str(SCHEMAS_PATH), help="the schema set (JSON)")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="output tokens at most")
    g.add_argument("--batch-sizes", default="1,32", help="overhead: comma-separated batch sizes")
    g.add_argument("--rounds", type=int, default=5, help="overhead: alternated rounds per mode")
    g.add_argument("--batch1-requests", type=int, default=8,
                   help="overhead: requests run one after another at batch 1")
    g.add_argument("--skip-overhead", action="store_true", help="only the validity part")
    g.add_argument("--skip-validity", action="store_true", help="only the overhead part")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary (benchmarks/setup_llama_server.sh); "
                        "without it only tokenmill's server is measured")
    g.add_argument("--llama-server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for llama-server (repeatable)")
    g.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `tokenmill serve` (repeatable)")
    g.add_argument("--result-file", default=None, help="write the result JSON here")
    g.add_argument("--markdown", default=None, help="also write the tables here")
    p.set_defaults(func=cmd_structured)


def cmd_structured(args: argparse.Namespace) -> int:
    """Run `tokenmill bench structured`."""
    from tokenmill.model_loader.gguf import embedded_model_path

    cases = load_schema_set(args.schemas)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.max_tokens < 1 or args.rounds < 1 or args.batch1_requests < 1 or not sizes \
            or min(sizes) < 1:
        raise ValueError("--max-tokens, --rounds, --batch1-requests and --batch-sizes must be >= 1")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        raise ValueError(f"--llama-server {args.llama_server} is not an executable file")
    model = args.model or embedded_model_path()
    threads = args.num_threads or os.cpu_count() or 1
    result: dict[str, Any] = {"date": now_iso(), "hardware": hardware(), "model": model,
                              "threads": threads, "schemas": args.schemas,
                              "num_schemas": len(cases), "max_tokens": args.max_tokens,
                              "command": " ".join(["tokenmill", *sys.argv[1:]])}
    tables = []
    if not args.skip_overhead:
        result["overhead"] = run_overhead(args, cases, sizes)
        tables.append(overhead_table(result["overhead"]))
        print(tables[-1], flush=True)
    if not args.skip_validity:
        from tokenmill.bench.structured_validity import validity_servers

        result["validity"] = validity_servers(cases, args.max_tokens, model, threads,
                                              args.serve_arg, args.llama_server,
                                              args.llama_server_arg)
        tables += [validity_table(result["validity"]), per_schema_table(result["validity"])]
        print(tables[-2] + "\n\n" + tables[-1], flush=True)
    if args.result_file:
        write_json(args.result_file, result)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write("\n\n".join(tables) + "\n")
    return 0


def run_overhead(args: argparse.Namespace, cases: list, sizes: list[int]) -> dict[str, Any]:
    """The in-process A/B on one engine sized for the largest batch; closed afterwards."""
    from tokenmill.bench.offline import engine_facts, load_engine
    from tokenmill.bench.structured_overhead import measure_overhead

    if args.max_num_seqs < max(sizes):
        args.max_num_seqs = max(sizes)
    engine, load_s = load_engine(args)
    try:
        runs = measure_overhead(engine, cases, sizes, args.rounds, args.batch1_requests,
                                args.max_tokens, log=lambda m: print(m, file=sys.stderr))
        return {"engine": engine_facts(engine, load_s), "batches": runs}
    finally:
        engine.close()


def overhead_table(overhead: dict[str, Any]) -> str:
    """One row per batch size: tokens/s of both modes and the overhead, median and best."""
    rows = []
    for b in overhead["batches"]:
        c, u = b["constrained"], b["unconstrained"]
        rows.append([b["batch_size"], b["requests"], sum(b["output_lengths"]),
                     f"{u['median_tokens_per_s']:.1f}", f"{c['median_tokens_per_s']:.1f}",
                     f"{u['median_tpot_ms']:.2f}", f"{c['median_tpot_ms']:.2f}",
                     f"{b['overhead_median_pct']:+.1f}%", f"{b['overhead_best_pct']:+.1f}%",
                     f"{b['valid']}/{b['requests']}"])
    return markdown_table(["batch", "requests", "output tokens", "free tok/s", "schema tok/s",
                           "free TPOT ms", "schema TPOT ms", "overhead (median)",
                           "overhead (best)", "valid"], rows)


def validity_table(validity: dict[str, Any]) -> str:
    """One row per server: valid outputs, cut by max_tokens, latency, tokens/s."""
    rows = []
    for name, r in validity.items():
        rows.append([name, f"{r['valid']}/{r['cases']} ({r['valid_pct']:.0f}%)",
                     f"{r['parsed']}/{r['cases']}", r["length_cut"],
                     f"{r['mean_latency_ms']:.0f}", f"{r['median_latency_ms']:.0f}",
                     r["completion_tokens"], f"{r['tokens_per_s']:.1f}"])
    return markdown_table(["server", "valid", "parsed", "cut by max_tokens", "mean latency ms",
                           "median latency ms", "completion tokens", "tokens/s"], rows)


def per_schema_table(validity: dict[str, Any]) -> str:
    """Each schema's verdict and tokens on every server measured."""
    servers = list(validity)
    by_name: dict[str, dict[str, dict[str, Any]]] = {}
    for s in servers:
        for r in validity[s]["results"]:
            by_name.setdefault(r["name"], {})[s] = r
    rows = []
    for name, per in by_name.items():
        row: list[Any] = [name]
        for s in servers:
            r = per.get(s)
            row.append("-" if r is None else
                       f"{'ok' if r['valid'] else 'INVALID'}, {r['completion_tokens']} tok")
        rows.append(row)
    return markdown_table(["schema", *servers], rows, align="l" * (1 + len(servers)))
