"""What ``--deterministic`` costs on the CPU: engines A/B alternated in one process on the same
workloads, best and median of the rounds.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/deterministic_ab.py --rounds 3 \
        --result-file benchmarks/results/deterministic-cpu.json

Modes: ``default`` (the engine as shipped), ``pinned`` (the default engine with every int4 /
int8 layer on its int kernel at every row count, as ``--deterministic`` has them, but the
default step layout: what the kernels cost apart from the step layout) and ``deterministic``.
Workloads: ``bench throughput``'s default (32 random prompts of 128 tokens, 128 output tokens
each), a prefill-heavy batch (16 x 512 prompt tokens, 16 output tokens), single-request greedy decode (128 tokens after a short prompt; tokens/s between
the first and the last token) and single-request prefill (a 500-token prompt, max_tokens 1;
prompt tokens / TTFT).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.bench.datasets import random_requests
from tokenmill.bench.report import hardware, now_iso, write_json
from tokenmill.bench.throughput import run_throughput
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.quant.model import pin_row_kernels
from tokenmill.runner.cpu_program import make_cpu_program
from tokenmill.sampling_params import SamplingParams

MODES = ("default", "pinned", "deterministic")


def _load_avg() -> float:
    return os.getloadavg()[0]


def throughput(num: int, input_len: int, output_len: int) -> Callable[[LLMEngine, int], float]:
    """Output tokens/s of ``num`` random prompts queued at once (``bench throughput``)."""
    def run(engine: LLMEngine, seed: int) -> float:
        reqs = random_requests(engine.tokenizer, num, input_len, output_len, seed=seed)
        return run_throughput(engine, reqs, 0.0, progress=False)["output_tokens_per_s"]
    return run


def decode_speed(engine: LLMEngine, seed: int) -> float:
    """Tokens/s of one greedy request between its first and its last token."""
    out = _one(engine, "The capital of France is", 128)
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


def prefill_speed(engine: LLMEngine, seed: int) -> float:
    """Prompt tokens/s of one 500-token prompt (its time to first token)."""
    ids = random_requests(engine.tokenizer, 1, 500, 1, seed=seed)[0].prompt
    start = time.perf_counter()
    out = _one(engine, ids, 1)
    return len(out.prompt_token_ids) / (time.perf_counter() - start)


def _one(engine: LLMEngine, prompt: Any, max_tokens: int) -> Any:
    engine.add_request(f"r{time.perf_counter_ns()}", prompt,
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


# Each workload gets new random prompts every round (the round's seed, the same for every
# mode), so that no round hits the prefix cache of an earlier one.
WORKLOADS: dict[str, tuple[str, Callable[[LLMEngine, int], float]]] = {
    "throughput-32x128-128": ("output tok/s", throughput(32, 128, 128)),
    "throughput-16x512-16": ("output tok/s", throughput(16, 512, 16)),
    "decode-1": ("tok/s", decode_speed),
    "prefill-500": ("prompt tok/s", prefill_speed),
}


def make_engine(mode: str, threads: int | None) -> LLMEngine:
    """The engine of one mode (see the module docstring)."""
    engine = LLM(deterministic=mode == "deterministic", num_threads=threads,
                 kv_cache_memory_bytes=256 << 20).engine
    if mode == "pinned":
        runner = engine.core.executor.runner
        pin_row_kernels(runner.model)
        # The fused stack sizes its batch limit from the layers' dense threshold: rebuild it.
        runner.cpu_program = make_cpu_program(runner.model, runner.device)
    _one(engine, "Hello", 8)  # warm-up: the first steps pay one-time costs
    return engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {list(WORKLOADS)}")
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    modes = args.modes.split(",")
    names = args.workloads.split(",")
    engines = {mode: make_engine(mode, args.threads) for mode in modes}
    samples: dict[str, dict[str, list[float]]] = {w: {m: [] for m in modes} for w in names}
    loads: list[float] = []
    for r in range(args.rounds):
        for name in names:
            # Alternate the order each round, so that neither mode always runs first.
            for mode in modes if r % 2 == 0 else list(reversed(modes)):
                loads.append(_load_avg())
                samples[name][mode].append(WORKLOADS[name][1](engines[mode], 1000 + r))
                print(f"round {r + 1} {name} {mode}: {samples[name][mode][-1]:.1f}",
                      file=sys.stderr, flush=True)
    result = _summary(samples, args.rounds, loads)
    _print_table(result, modes)
    if args.result_file:
        write_json(args.result_file, result)
    return 0


def _summary(samples: dict[str, dict[str, list[float]]], rounds: int,
             loads: list[float]) -> dict[str, Any]:
    rows = [{"workload": name, "unit": WORKLOADS[name][0], "samples": by_mode,
             "best": {m: max(v) for m, v in by_mode.items()},
             "median": {m: statistics.median(v) for m, v in by_mode.items()}}
            for name, by_mode in samples.items()]
    return {"date": now_iso(), "hardware": hardware(), "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rounds": rounds,
            "load_average_before_each_run": loads,
            "command": " ".join(["python", *sys.argv]), "results": rows}


def _print_table(result: dict[str, Any], modes: list[str]) -> None:
    print("| workload | unit | " + " | ".join(f"{m} (best / median)" for m in modes) + " |")
    print("| --- | --- |" + " ---: |" * len(modes))
    for row in result["results"]:
        cells = [f"{row['best'][m]:.1f} / {row['median'][m]:.1f}" for m in modes]
        print(f"| {row['workload']} | {row['unit']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
