"""`tokenmill bench prefix-cache`: TTFT of a request whose long prefix is cached, vs uncached.

The workload of a shared system prompt or document: requests that start with the same
``--prefix-len`` tokens and end with ``--suffix-len`` tokens of their own. Uncached: every
request has a prefix nobody sent before. Cached: every request reuses one prefix, sent once
beforehand. One engine, one request at a time; medians over ``--num-iters``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any

from tokenmill.bench.datasets import SampleRequest, fit_prompt
from tokenmill.bench.latency import time_one
from tokenmill.bench.offline import add_offline_args, engine_facts, load_engine
from tokenmill.bench.report import hardware, markdown_table, now_iso, peak_rss_mib, write_json


def add_prefix_cache_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench prefix-cache`."""
    p = subparsers.add_parser("prefix-cache", help="TTFT with a cached long prefix vs without",
                              description=__doc__.splitlines()[0])
    add_offline_args(p, input_len="1000", output_len="8", num_prompts=None)
    p.add_argument("--suffix-len", type=int, default=24, help="tokens after the shared prefix")
    p.add_argument("--num-iters", type=int, default=5, help="timed iterations")
    p.add_argument("--markdown", default=None, help="also write the table here")
    p.set_defaults(func=cmd_prefix_cache)


def cmd_prefix_cache(args: argparse.Namespace) -> int:
    """Run `tokenmill bench prefix-cache` (``--input-len`` is the prefix length)."""
    prefix_len, n = int(args.input_len), args.num_iters
    if prefix_len < 1 or args.suffix_len < 1 or n < 1:
        raise ValueError("--input-len, --suffix-len and --num-iters must be >= 1")
    if not args.enable_prefix_caching:
        raise ValueError("bench prefix-cache measures the prefix cache: leave it enabled")
    engine, load_s = load_engine(args)
    rng = random.Random(args.seed)
    tok = engine.tokenizer

    def ids(length: int) -> list[int]:
        return fit_prompt(tok, length, rng)[1]

    out_len = int(args.output_len)
    # Uncached first: fresh prefixes, so nothing of them is in the cache.
    cold = [time_one(engine, f"cold-{i}", SampleRequest(ids(prefix_len) + ids(args.suffix_len),
                                                        0, out_len), args.temperature)
            for i in range(n + 1)][1:]  # the first one pays one-time warm-up costs
    shared = ids(prefix_len)
    time_one(engine, "prime", SampleRequest(shared + ids(args.suffix_len), 0, out_len),
             args.temperature)
    warm = [time_one(engine, f"warm-{i}", SampleRequest(shared + ids(args.suffix_len), 0, out_len),
                     args.temperature) for i in range(n)]
    stats = engine.stats()
    cold_ms = statistics.median(t.ttft for t in cold) * 1000
    warm_ms = statistics.median(t.ttft for t in warm) * 1000
    result: dict[str, Any] = {
        "prefix_tokens": prefix_len, "suffix_tokens": args.suffix_len, "output_tokens": out_len,
        "num_iters": n, "ttft_uncached_ms": cold_ms, "ttft_cached_ms": warm_ms,
        "cached_over_uncached": warm_ms / cold_ms,
        "ttft_uncached_all_ms": [t.ttft * 1000 for t in cold],
        "ttft_cached_all_ms": [t.ttft * 1000 for t in warm],
        "prefix_cache_queries": stats.prefix_cache_queries_total,
        "prefix_cache_hits": stats.prefix_cache_hits_total,
        "peak_rss_mib": peak_rss_mib(), "date": now_iso(), "hardware": hardware(),
        "engine": engine_facts(engine, load_s),
        "command": " ".join(["tokenmill", *sys.argv[1:]]),
    }
    table = markdown_table(
        ["prompt", "median TTFT (ms)", "vs uncached"],
        [[f"{prefix_len} new + {args.suffix_len} tokens (uncached)", f"{cold_ms:.1f}", "1.00x"],
         [f"{prefix_len} cached + {args.suffix_len} new tokens", f"{warm_ms:.1f}",
          f"{warm_ms / cold_ms:.2f}x"]])
    print(table)
    print(f"prefix cache: {stats.prefix_cache_hits_total} of {stats.prefix_cache_queries_total} "
          "prompt tokens were hits")
    if args.result_file:
        write_json(args.result_file, result)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    return 0
