"""What the sampled tokens' logprobs (the drift monitor's mean output logprob) cost a decode
step: the logsumexp alone on a step's logits, and whole decode steps with it on and off,
alternated in one process on the same engine.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/logprob_cost.py --rounds 5 \
        --result-file benchmarks/results/logprob-cost-cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from tokenmill.bench.datasets import random_requests
from tokenmill.bench.report import hardware, now_iso, write_json
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.runner.sampler import logprobs_of
from tokenmill.sampling_params import SamplingParams


def op_ms(batch: int, vocab: int, repeats: int = 200) -> float:
    """Median ms of ``logprobs_of`` on float32 logits [batch, vocab]."""
    logits = torch.randn(batch, vocab)
    ids = torch.randint(0, vocab, (batch,))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        logprobs_of(logits, ids)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def decode_step_ms(engine: LLMEngine, batch: int, seed: int, tokens: int = 64) -> float:
    """Median ms of the decode-only steps of ``batch`` greedy requests of ``tokens`` tokens."""
    for i, req in enumerate(random_requests(engine.tokenizer, batch, 32, tokens, seed=seed)):
        engine.add_request(f"s{seed}-{i}", req.prompt, SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        n, k = engine.last_batch
        if n == batch and k == batch:  # every request decoding one token
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    engine = LLM(kv_cache_memory_bytes=256 << 20).engine
    sampler = engine.core.executor.runner.sampler
    vocab = engine.vocab_size
    decode_step_ms(engine, 1, seed=999, tokens=8)  # warm-up
    rows: list[dict[str, Any]] = []
    for batch in (int(b) for b in args.batches.split(",")):
        steps: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):  # alternated
                sampler.chosen_logprobs = on
                steps[on].append(decode_step_ms(engine, batch, seed=r))
        sampler.chosen_logprobs = True
        op = op_ms(batch, vocab)
        on, off = statistics.median(steps[True]), statistics.median(steps[False])
        rows.append({"batch": batch, "logsumexp_ms": op, "step_ms_on": on, "step_ms_off": off,
                     "op_share_of_step": op / off, "step_difference": on / off - 1,
                     "rounds_on": steps[True], "rounds_off": steps[False]})
    print(f"{'batch':>5} {'logsumexp ms':>13} {'step ms on':>11} {'step ms off':>12} "
          f"{'op/step':>8} {'on/off-1':>9}")
    for row in rows:
        print(f"{row['batch']:>5} {row['logsumexp_ms']:>13.3f} {row['step_ms_on']:>11.2f} "
              f"{row['step_ms_off']:>12.2f} {row['op_share_of_step']:>8.2%} "
              f"{row['step_difference']:>+9.2%}")
    if args.result_file:
        write_json(args.result_file, {
            "benchmark": "logprob-cost", "date": now_iso(), "hardware": hardware(),
            "threads": torch.get_num_threads(), "vocab": vocab, "load_avg": os.getloadavg(),
            "command": "python benchmarks/logprob_cost.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
            "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
