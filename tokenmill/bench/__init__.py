"""`tokenmill bench`: load generator, offline throughput and latency, and the peer comparison.

Each sub-command lives in its own module and registers itself with ``add_<name>_parser``;
heavy imports (httpx, torch, matplotlib) happen inside the commands, so building the parser
stays cheap for every other `tokenmill` command.
"""

from __future__ import annotations

import argparse


def add_bench_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench serve|throughput|latency|compare|prefix-cache|spec|batch|gpu` and
    `perplexity`."""
    from tokenmill.bench.batch import add_batch_bench_parser
    from tokenmill.bench.compare import add_compare_parser
    from tokenmill.bench.gpu import add_gpu_parser
    from tokenmill.bench.latency import add_latency_parser
    from tokenmill.bench.prefix_cache import add_prefix_cache_parser
    from tokenmill.bench.serve import add_serve_parser
    from tokenmill.bench.spec import add_spec_parser
    from tokenmill.bench.throughput import add_throughput_parser

    add_serve_parser(subparsers)
    add_throughput_parser(subparsers)
    add_latency_parser(subparsers)
    add_compare_parser(subparsers)
    add_prefix_cache_parser(subparsers)
    add_spec_parser(subparsers)
    add_batch_bench_parser(subparsers)
    add_gpu_parser(subparsers)
    _add_perplexity_parser(subparsers)


def _add_perplexity_parser(subparsers: argparse._SubParsersAction) -> None:
    """`bench perplexity` comes from tokenmill/bench/perplexity.py, a separate module.

    This parser is built for every `tokenmill` command, so a missing module leaves the
    sub-command out and a broken one only breaks `bench perplexity` itself (it then explains
    the import error), never `tokenmill serve` and the rest.
    """
    try:
        from tokenmill.bench.perplexity import add_perplexity_parser  # type: ignore[import-not-found]
    except ModuleNotFoundError as e:
        if e.name == "tokenmill.bench.perplexity":
            return
        error: ImportError = e
    except ImportError as e:
        error = e
    else:
        add_perplexity_parser(subparsers)
        return

    def unavailable(args: argparse.Namespace) -> int:
        raise ValueError(f"bench perplexity is unavailable: {error}")

    p = subparsers.add_parser("perplexity", help="(unavailable: see `bench perplexity`)")
    p.set_defaults(func=unavailable)
