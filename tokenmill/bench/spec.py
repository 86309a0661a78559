"""`tokenmill bench spec`: single-stream decode speed with and without speculative decoding.

Each mode (``none``, ``ngram``, ``self:N`` for a self-draft of the target's first N layers, or
a draft model path) gets its own engine and generates, greedily and one request at a time,
``--max-tokens`` tokens for each task: ``code`` (a 40-line function to repeat with another
name: prompt lookup's best case) and ``chat`` (an ordinary question). Reported: decode tokens/s
((output tokens - 1) / (end - first token), median over the timed runs), the speed-up over
``none``, the mean acceptance length (tokens per verification: accepted drafts + 1) and rate,
and whether the output equals ``none``'s token for token.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any

from tokenmill.bench.report import hardware, hardware_line, now_iso, write_json
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.output_processor import OutputKind
from tokenmill.sampling_params import SamplingParams

CODE = '''def merge_intervals(intervals, gap=0):
    """Merge overlapping or nearly touching intervals.

    Intervals are (start, end) pairs; two intervals merge when the second one starts at most
    `gap` after the first one ends. The result is sorted by start.
    """
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1] + gap:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_covered(intervals):
    """Total length covered by the intervals, counting overlaps once."""
    return sum(end - start for start, end in merge_intervals(intervals))


def find_gaps(intervals, lower, upper):
    """The uncovered stretches between lower and upper."""
    gaps = []
    cursor = lower
    for start, end in merge_intervals(intervals):
        if start > cursor:
            gaps.append((cursor, min(start, upper)))
        cursor = max(cursor, end)
        if cursor >= upper:
            break
    if cursor < upper:
        gaps.append((cursor, upper))
    return gaps
'''

TASKS: dict[str, str] = {
    "code": f"```python\n{CODE}```\n\nRepeat this code exactly, changing the function name "
            "merge_intervals to combine_ranges.",
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


@dataclasses.dataclass
class Run:
    """One generation: its tokens and when the first and last came (seconds from the start)."""

    token_ids: list[int]
    ttft: float
    e2e: float

    @property
    def decode_tps(self) -> float:
        return (len(self.token_ids) - 1) / (self.e2e - self.ttft)


def run_one(engine: LLMEngine, rid: str, prompt: dict, max_tokens: int) -> Run:
    """Generate ``max_tokens`` tokens greedily (EOS ignored, so every mode does the same work)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params, kind=OutputKind.DELTA)
    tokens: list[int] = []
    first = last = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = out.outputs[0].token_ids
            if new:
                last = time.perf_counter() - start
                first = first or last
                tokens.extend(new)
    return Run(tokens, first, last)


def bench_mode(args: argparse.Namespace, mode: str, tasks: list[str],
               baseline: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Every task under one speculative mode, on a fresh engine."""
    from tokenmill.cli import engine_config_from_args

    base = engine_config_from_args(args)
    spec = SpeculativeConfig.from_options(
        "ngram" if mode == "ngram" else "none", None if mode in ("none", "ngram") else mode,
        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
        ngram_max=args.ngram_max)
    engine = LLMEngine(dataclasses.replace(base, speculative=spec))
    rows = []
    for task in tasks:
        prompt = chat_prompt(engine, task)
        for i in range(args.num_warmups):
            run_one(engine, f"{mode}-{task}-warmup-{i}", prompt, args.max_tokens)
        before = _spec_totals(engine)
        runs = [run_one(engine, f"{mode}-{task}-{i}", prompt, args.max_tokens)
                for i in range(args.num_iters)]
        after = _spec_totals(engine)
        drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before, strict=True))
        baseline.setdefault(task, runs[0].token_ids)
        rows.append({
            "mode": mode, "task": task, "prompt_tokens": len(prompt["prompt_token_ids"]),
            "output_tokens": len(runs[0].token_ids),
            "decode_tokens_per_s": statistics.median(r.decode_tps for r in runs),
            "e2e_s": statistics.median(r.e2e for r in runs),
            "decode_tokens_per_s_runs": [r.decode_tps for r in runs],
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "verification_steps": drafts // args.num_iters,
            "same_tokens_as_none": runs[0].token_ids == baseline[task],
        })
    return rows


def _spec_totals(engine: LLMEngine) -> tuple[int, int, int]:
    stats = engine.core.spec_stats
    if stats is None:
        return 0, 0, 0
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def add_spec_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench spec`."""
    from tokenmill.cli import add_engine_args

    p = subparsers.add_parser("spec", help="decode speed-up of speculative decoding",
                              description=__doc__.splitlines()[0])
    add_engine_args(p)
    g = p.add_argument_group("speculative benchmark")
    g.add_argument("--modes", default="none,ngram,self:4",
                   help="comma-separated: none, ngram, self:N or a draft model path; 'none' "
                        "first is the baseline (--speculative/--speculative-model are ignored)")
    g.add_argument("--tasks", default="code,chat", help=f"comma-separated of {sorted(TASKS)}")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--num-iters", type=int, default=3, help="timed runs per mode and task")
    g.add_argument("--num-warmups", type=int, default=1)
    g.add_argument("--result-file", default=None, help="write the result JSON here")
    p.set_defaults(func=cmd_spec)


def cmd_spec(args: argparse.Namespace) -> int:
    """Run `tokenmill bench spec`."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if not modes or not tasks or unknown:
        raise ValueError(f"--modes and --tasks must be non-empty; unknown tasks {unknown}")
    if args.num_iters < 1 or args.num_warmups < 0:
        raise ValueError("--num-iters must be >= 1 and --num-warmups >= 0")
    rows: list[dict[str, Any]] = []
    baseline: dict[str, list[int]] = {}
    for mode in modes:
        rows.extend(bench_mode(args, mode, tasks, baseline))
    add_speedups(rows)
    hw = hardware()
    result = {"date": now_iso(), "hardware": hw, "command": " ".join(["tokenmill", *sys.argv[1:]]),
              "max_tokens": args.max_tokens, "num_speculative_tokens": args.num_speculative_tokens,
              "ngram_min": args.ngram_min, "ngram_max": args.ngram_max, "rows": rows}
    print(f"{hardware_line(hw)}, torch {hw.get('torch')}, {args.threads or 'all'} threads; "
          f"greedy, {args.max_tokens} tokens, K={args.num_speculative_tokens}, "
          f"median of {args.num_iters}")
    print(format_table(rows))
    if args.result_file:
        write_json(args.result_file, result)
    return 0


def chat_prompt(engine: LLMEngine, task: str) -> dict:
    """The task's text as one user message in the model's chat template."""
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": TASKS[task]}],
                                   add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Each row's decode speed over the "none" row of its task (None without one)."""
    base = {r["task"]: r["decode_tokens_per_s"] for r in rows if r["mode"] == "none"}
    for r in rows:
        b = base.get(r["task"])
        r["speedup"] = r["decode_tokens_per_s"] / b if b else None


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the rows."""
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = ["| mode | task | decode tok/s | speed-up | acceptance length | acceptance rate "
             "| same tokens as none |",
             "|------|------|-------------:|---------:|------------------:|----------------:"
             "|:-------------------:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['task']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{num(r['speedup'], '.2f')}x | {num(r['mean_acceptance_length'], '.2f')} | "
                     f"{num(r['acceptance_rate'], '.2f')} | "
                     f"{'yes' if r['same_tokens_as_none'] else 'no'} |")
    return "\n".join(lines)
