"""`tokenmill bench batch`: the batch job against `bench throughput` on the same requests.

Both run on one engine, loaded once, with the same prompts and output lengths (EOS ignored):
`bench throughput` queues every request and steps the engine; the batch job reads them as
/v1/completions lines of a JSONL file, validates, batches, answers and appends each result to
its results file. Runs alternate (throughput, batch, throughput, ...) so that both see the
same machine; the ratio of the medians is what the batch job's bookkeeping costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

from tokenmill.batch import DEFAULT_MAX_IN_FLIGHT
from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.offline import add_offline_args, engine_facts, load_engine, warm_up, workload
from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json
from tokenmill.bench.throughput import run_throughput
from tokenmill.engine.llm_engine import LLMEngine


def add_batch_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench batch`."""
    p = subparsers.add_parser("batch", help="the batch job vs bench throughput, same requests",
                              description=__doc__.splitlines()[0])
    add_offline_args(p, input_len="128", output_len="128", num_prompts=64)
    p.add_argument("--num-iters", type=int, default=3, help="runs of each, alternating")
    p.add_argument("--num-warmups", type=int, default=1, help="untimed iterations first")
    p.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT, help="requests in the engine at once")
    p.add_argument("--markdown-file", default=None, help="also write the table here")
    p.set_defaults(func=cmd_batch_bench)


def write_requests(path: str, requests: list[SampleRequest], temperature: float) -> None:
    """The workload as an OpenAI Batch API input file of /v1/completions lines."""
    with open(path, "w", encoding="utf-8") as f:
        for i, req in enumerate(requests):
            body = {"prompt": req.prompt, "max_tokens": req.output_len,
                    "temperature": temperature, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                "url": "/v1/completions", "body": body}) + "\n")


def run_batch_once(engine: LLMEngine, input_path: str, output_path: str,
                   max_in_flight: int) -> dict[str, Any]:
    """One batch job from scratch, in the shape of run_throughput's result."""
    from tokenmill.batch import run_batch

    if os.path.exists(output_path):
        os.remove(output_path)
    stats = run_batch(input_path, output_path, engine, max_in_flight=max_in_flight,
                      progress=False)
    if stats.succeeded != stats.answered:
        raise RuntimeError(f"the batch job failed {stats.failed} requests; see {output_path}")
    secs = stats.elapsed_s
    return {"num_requests": stats.answered, "elapsed_s": secs,
            "total_input_tokens": stats.prompt_tokens,
            "total_output_tokens": stats.output_tokens,
            "requests_per_s": stats.answered / secs,
            "output_tokens_per_s": stats.output_tokens / secs,
            "total_tokens_per_s": (stats.prompt_tokens + stats.output_tokens) / secs}


def table(result: dict[str, Any]) -> str:
    """Median of each over the runs, and batch / throughput; then the ratio of each pair."""
    tp, b = result["throughput"]["median"], result["batch"]["median"]
    rows = [[name, tp[key], b[key], f"{b[key] / tp[key]:.3f}"]
            for name, key in (("requests/s", "requests_per_s"),
                              ("output tok/s", "output_tokens_per_s"),
                              ("total tok/s", "total_tokens_per_s"))]
    pairs = ", ".join(f"{r:.3f}" for r in result["pair_ratios"])
    rows.append([f"output tok/s, run by run ({pairs})", "-", "-",
                 f"{result['median_pair_ratio']:.3f} (median)"])
    return markdown_table(["median of runs", "bench throughput", "tokenmill batch",
                           "batch / throughput"], rows)


def cmd_batch_bench(args: argparse.Namespace) -> int:
    """Run `tokenmill bench batch`."""
    if args.num_prompts < 1 or args.num_iters < 1:
        raise ValueError("--num-prompts and --num-iters must be >= 1")
    engine, load_s = load_engine(args)
    requests = workload(engine, args, args.num_prompts)
    warm_up(engine, requests[0], args.num_warmups)
    runs: dict[str, list[dict[str, Any]]] = {"throughput": [], "batch": []}
    with tempfile.TemporaryDirectory() as tmp:
        input_path = os.path.join(tmp, "requests.jsonl")
        write_requests(input_path, requests, args.temperature)
        for _ in range(args.num_iters):
            runs["throughput"].append(run_throughput(engine, requests, args.temperature,
                                                     progress=False))
            runs["batch"].append(run_batch_once(engine, input_path,
                                                os.path.join(tmp, "results.jsonl"),
                                                args.max_in_flight))
    result: dict[str, Any] = {
        name: {"runs": rs, "median": {k: statistics.median(r[k] for r in rs) for k in rs[0]}}
        for name, rs in runs.items()}
    # Each pair ran back to back, so its ratio is the least disturbed by other load.
    result["pair_ratios"] = [b["output_tokens_per_s"] / t["output_tokens_per_s"]
                             for t, b in zip(runs["throughput"], runs["batch"], strict=True)]
    result["median_pair_ratio"] = statistics.median(result["pair_ratios"])
    hw = hardware()
    result.update(date=now_iso(), engine=engine_facts(engine, load_s), hardware=hw,
                  workload={"num_prompts": args.num_prompts, "input_len": args.input_len,
                            "output_len": args.output_len, "dataset": args.dataset},
                  command=" ".join(["tokenmill", *sys.argv[1:]]))
    text = table(result)
    print(text)
    if args.result_file:
        write_json(args.result_file, result)
    if args.markdown_file:
        with open(args.markdown_file, "w", encoding="utf-8") as f:
            f.write(f"# tokenmill batch vs bench throughput\n\n{hardware_line(hw)}; "
                    f"{now_iso()}\n\n`{result['command']}`\n\n{text}\n")
    return 0
