"""`tokenmill bench throughput`: the offline engine on many prompts at once.

All prompts are queued together and the engine steps until every one is done: the number is
what continuous batching gets out of the machine (requests/s, output and total tokens/s), with
the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.offline import (
    add_offline_args,
    energy_line,
    energy_report,
    engine_facts,
    load_engine,
    sampling,
    warm_up,
    workload,
)
from tokenmill.bench.report import hardware, now_iso, peak_rss_mib, write_json
from tokenmill.engine.llm_engine import LLMEngine


def run_throughput(engine: LLMEngine, requests: list[SampleRequest], temperature: float,
                   progress: bool = True) -> dict[str, Any]:
    """Generate every request to its full output length; counts and rates of the run."""
    from tqdm import tqdm

    for i, req in enumerate(requests):
        engine.add_request(f"tp-{i}", req.prompt, sampling(req, temperature))
    out_tokens = in_tokens = done = steps = 0
    usage_before = engine.stats().usage_total
    start = time.perf_counter()
    with tqdm(total=len(requests), desc="bench throughput", unit="req", disable=not progress) as bar:
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    done += 1
                    in_tokens += len(out.prompt_token_ids)
                    out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
    elapsed = time.perf_counter() - start
    return {"num_requests": done, "elapsed_s": elapsed, "engine_steps": steps,
            "ms_per_step": elapsed / max(steps, 1) * 1000,
            "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "requests_per_s": done / elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
            **energy_report(engine, usage_before, out_tokens)}


def add_throughput_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench throughput`."""
    p = subparsers.add_parser("throughput", help="offline engine throughput on many prompts",
                              description=__doc__.splitlines()[0])
    add_offline_args(p, input_len="128", output_len="128", num_prompts=32)
    p.add_argument("--num-warmups", type=int, default=1, help="untimed iterations first")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_throughput)


def cmd_throughput(args: argparse.Namespace) -> int:
    """Run `tokenmill bench throughput`."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    engine, load_s = load_engine(args)
    requests = workload(engine, args, args.num_prompts)
    warm_up(engine, requests[0], args.num_warmups)
    result = run_throughput(engine, requests, args.temperature, args.progress)
    result.update(peak_rss_mib=peak_rss_mib(), date=now_iso(), dataset=args.dataset,
                  engine=engine_facts(engine, load_s), hardware=hardware(),
                  command=" ".join(["tokenmill", *sys.argv[1:]]))
    print(f"{result['num_requests']} requests, {result['total_input_tokens']} prompt + "
          f"{result['total_output_tokens']} output tokens in {result['elapsed_s']:.2f} s")
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, "
          f"{result['output_tokens_per_s']:.1f} output tok/s, "
          f"{result['total_tokens_per_s']:.1f} total tok/s")
    print(energy_line(result))
    print(f"Peak memory (RSS): {result['peak_rss_mib']:.0f} MiB")
    if args.result_file:
        write_json(args.result_file, result)
    return 0
