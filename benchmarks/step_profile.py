"""Where a decode step's time goes: the embedded model (int4, fused C++ decode stack) at batch 1
and at batch 32, each step timed whole and then profiled with torch.profiler, ops grouped
into kernels (int4 matmul, int8 head, ...), the fused C++ stack's own work (its profiler range
minus the ATen ops inside it: attention, norms, rotary) and "Python" for the step's time outside
all of these (scheduling, input building, sampling glue, output processing).

    python benchmarks/step_profile.py [--batches 1,32] [--steps 20] [--prompt-tokens 128]
        [--result-file FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM
from tokenmill.bench.latency import start_decoding
from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json
from tokenmill.runner.cpu_program import PROFILE_RANGE

PROMPT_TOKENS = 128
# Op name fragments -> the group a table row names (first match wins).
GROUPS = [
    ("int4 matmul", ("int4pack", "int4")),
    ("int8 matmul (tied head)", ("int8", "_int_mm", "weight_int8")),
    ("fp32 matmul", ("addmm", "aten::mm", "matmul", "linear", "bmm")),
    ("attention", ("attention", "attn", "softmax", "sdpa")),
    ("fused layer stack (own code)", ("fused", "tokenmill")),
    ("sampling", ("sort", "topk", "multinomial", "argmax", "logsumexp", "log_softmax",
                  "exponential", "cumsum")),
    ("norms, rotary, activations", ("rms", "norm", "silu", "mul", "rsqrt", "cos", "sin",
                                    "pow", "mean", "add")),
    ("copies, indexing", ("copy", "index", "cat", "stack", "gather", "scatter", "to", "empty",
                          "zeros", "fill", "slice", "select", "view", "reshape", "contiguous")),
]


def group_of(name: str) -> str:
    if name == PROFILE_RANGE:
        return "fused stack's own C++ (attention, norms, rotary, glue)"
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other ops"


def decode_steps(llm: LLM, batch: int, steps: int, seed: int,
                 prompt_tokens: int = PROMPT_TOKENS) -> tuple[list[float], Any]:
    """Queue ``batch`` requests, run their prefill, then time ``steps`` decode steps; the last
    ``steps`` of them run under the profiler. Returns the step times and the profile."""
    engine = llm.engine
    start_decoding(engine, batch, prompt_tokens, 2 * steps + 8, seed)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return times, prof


def breakdown(prof: Any, steps: int, step_ms: float) -> list[tuple[str, float]]:
    """(group, ms per step) over the top-level ops of the profile, plus Python's remainder."""
    groups: dict[str, float] = {}
    for evt in prof.key_averages():
        # Self CPU time: each op's own time, so nested ops are not counted twice.
        ms = evt.self_cpu_time_total / 1000 / steps
        groups[group_of(evt.key)] = groups.get(group_of(evt.key), 0.0) + ms
    total_ops = sum(groups.values())
    groups["Python (scheduler, inputs, outputs)"] = max(step_ms - total_ops, 0.0)
    return sorted(groups.items(), key=lambda kv: -kv[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                    help="each request's prompt length: the decode steps' context")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    llm = LLM(max_num_seqs=64)
    results: dict[str, Any] = {}
    for n, batch in enumerate(int(b) for b in a.batches.split(",")):
        decode_steps(llm, batch, 4, seed=100 + n, prompt_tokens=a.prompt_tokens)  # warm-up of this batch size
        times, prof = decode_steps(llm, batch, a.steps, seed=n, prompt_tokens=a.prompt_tokens)
        step_ms = statistics.median(times) * 1000
        rows = breakdown(prof, a.steps, step_ms)
        results[str(batch)] = {"step_ms_median": step_ms,
                               "tokens_per_s": batch / (step_ms / 1000),
                               "groups_ms": dict(rows),
                               "top_ops": [(e.key, e.self_cpu_time_total / 1000 / a.steps)
                                           for e in sorted(prof.key_averages(),
                                                           key=lambda e: -e.self_cpu_time_total)
                                           [:15]]}
        print(f"\nbatch {batch}: decode step {step_ms:.1f} ms (median of {a.steps}), "
              f"{batch / (step_ms / 1000):.1f} tok/s")
        print(markdown_table(["where", "ms per step", "share"],
                             [[g, ms, f"{ms / step_ms:.0%}"] for g, ms in rows]))
        print(markdown_table(["op (self time)", "ms per step"],
                             results[str(batch)]["top_ops"]))
    hw = hardware()
    print(f"\n{hardware_line(hw)}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "hardware": hw,
                                   "threads": torch.get_num_threads(), "results": results})


if __name__ == "__main__":
    main()
