"""`tokenmill bench spec`: single-stream decode speed with and without speculative decoding.

Each mode (``none``, ``ngram``, ``self:N`` for a self-draft of the target's first N layers, or
a draft model path) gets its own engine; the modes take turns generating, greedily and one
request at a time, ``--max-tokens`` tokens for each task: ``code`` (a 35-line function to
repeat with another name: prompt lookup's best case) and ``chat`` (an ordinary request).
Reported: decode tokens/s ((output tokens - 1) / (last token - first token), median over the
timed runs), the speed-up over ``none``, the mean acceptance length (tokens per verification:
accepted drafts + 1) and rate, and whether the output equals the first mode's token for token.
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
from tokenmill.engine.args import add_engine_args, engine_config_from_args
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.output_processor import OutputKind
from tokenmill.sampling_params import SamplingParams

CODE = '''def summarize_orders(orders, min_total=0.0):
    """Group orders by customer and report what each one spent.

    Each order is a dict with the keys "customer", "items" and "shipped". An item is a
    (name, quantity, unit_price) tuple. Customers whose total is below min_total are left out.
    """
    totals = {}
    counts = {}
    pending = {}
    for order in orders:
        customer = order["customer"]
        amount = 0.0
        for name, quantity, unit_price in order["items"]:
            if quantity <= 0:
                raise ValueError(f"order for {customer} has {quantity} x {name}")
            amount += quantity * unit_price
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
        if not order["shipped"]:
            pending[customer] = pending.get(customer, 0) + 1
    report = []
    for customer in sorted(totals):
        total = totals[customer]
        if total < min_total:
            continue
        average = total / counts[customer]
        report.append({
            "customer": customer,
            "orders": counts[customer],
            "total": round(total, 2),
            "average": round(average, 2),
            "pending": pending.get(customer, 0),
        })
    report.sort(key=lambda row: row["total"], reverse=True)
    return report
'''

TASKS: dict[str, str] = {
    "code": f"```python\n{CODE}```\n\nRepeat this code exactly, changing the function name "
            "summarize_orders to customer_report.",
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


def make_engine(args: argparse.Namespace, mode: str) -> LLMEngine:
    """An engine with the command's options and ``mode``'s speculative decoding."""
    spec = SpeculativeConfig.from_options(
        "ngram" if mode == "ngram" else "none", None if mode in ("none", "ngram") else mode,
        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
        ngram_max=args.ngram_max)
    return LLMEngine(dataclasses.replace(engine_config_from_args(args), speculative=spec))


def run_timed(engine: LLMEngine, rid: str, prompt: dict, max_tokens: int,
              ) -> tuple[Run, tuple[int, int, int]]:
    """One run and what it added to (verified drafts, draft tokens, accepted tokens)."""
    before = _spec_totals(engine)
    run = run_one(engine, rid, prompt, max_tokens)
    after = _spec_totals(engine)
    return run, (after[0] - before[0], after[1] - before[1], after[2] - before[2])


def _spec_totals(engine: LLMEngine) -> tuple[int, int, int]:
    stats = engine.stats().spec_decoding
    if stats is None:
        return 0, 0, 0
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def summarize(mode: str, task: str, prompt: dict, runs: list[Run],
              counts: list[tuple[int, int, int]], baseline: list[int]) -> dict[str, Any]:
    """One row of the table: medians over the runs, acceptance over all of them."""
    drafts, draft_tokens, accepted = (sum(c[i] for c in counts) for i in range(3))
    return {
        "mode": mode, "task": task, "prompt_tokens": len(prompt["prompt_token_ids"]),
        "output_tokens": len(runs[0].token_ids),
        "decode_tokens_per_s": statistics.median(r.decode_tps for r in runs),
        "e2e_s": statistics.median(r.e2e for r in runs),
        "decode_tokens_per_s_runs": [r.decode_tps for r in runs],
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "verification_steps_per_run": drafts / len(runs),
        "same_tokens_as_first_mode": runs[0].token_ids == baseline,
    }


def add_spec_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench spec`."""
    p = subparsers.add_parser("spec", help="decode speed-up of speculative decoding",
                              description=__doc__.splitlines()[0])
    add_engine_args(p)
    g = p.add_argument_group("speculative benchmark")
    g.add_argument("--modes", default="none,ngram,self:4",
                   help="comma-separated: none, ngram, self:N or a draft model path; the first "
                        "is the baseline of 'same tokens' (--speculative/--speculative-model "
                        "are ignored)")
    g.add_argument("--tasks", default="code,chat", help=f"comma-separated of {sorted(TASKS)}")
    g.add_argument("--max-tokens", type=int, default=256, help="output tokens at most")
    g.add_argument("--num-iters", type=int, default=3, help="timed runs per mode and task")
    g.add_argument("--num-warmups", type=int, default=1, help="untimed iterations first")
    g.add_argument("--result-file", default=None, help="write the result JSON here")
    # One engine per mode, all loaded at once: a small KV cache each (one stream needs little).
    p.set_defaults(func=cmd_spec, num_kv_blocks=256)


def cmd_spec(args: argparse.Namespace) -> int:
    """Run `tokenmill bench spec`."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if not modes or not tasks or unknown:
        raise ValueError(f"--modes and --tasks must be non-empty; unknown tasks {unknown}")
    if args.num_iters < 1 or args.num_warmups < 0:
        raise ValueError("--num-iters must be >= 1 and --num-warmups >= 0")
    engines = {mode: make_engine(args, mode) for mode in modes}
    prompts = {task: chat_prompt(engines[modes[0]], task) for task in tasks}
    runs: dict[tuple[str, str], list[Run]] = {(m, t): [] for m in modes for t in tasks}
    counts: dict[tuple[str, str], list[tuple[int, int, int]]] = {k: [] for k in runs}
    # Modes take turns within each iteration, so that a change in the machine's load (it is
    # shared) hits every mode alike.
    for i in range(-args.num_warmups, args.num_iters):
        for task in tasks:
            for mode in modes:
                run, count = run_timed(engines[mode], f"{mode}-{task}-{i}", prompts[task],
                                       args.max_tokens)
                if i >= 0:
                    runs[mode, task].append(run)
                    counts[mode, task].append(count)
    rows = [summarize(m, t, prompts[t], runs[m, t], counts[m, t], runs[modes[0], t][0].token_ids)
            for t in tasks for m in modes]
    add_speedups(rows)
    hw = hardware()
    result = {"date": now_iso(), "hardware": hw, "command": " ".join(["tokenmill", *sys.argv[1:]]),
              "max_tokens": args.max_tokens, "num_speculative_tokens": args.num_speculative_tokens,
              "ngram_min": args.ngram_min, "ngram_max": args.ngram_max, "rows": rows}
    print(f"{hardware_line(hw)}, torch {hw.get('torch')}, {args.num_threads or 'all'} threads; "
          f"greedy, {args.max_tokens} tokens, K={args.num_speculative_tokens}, "
          f"median of {args.num_iters}")
    print(format_table(rows))
    if args.result_file:
        write_json(args.result_file, result)
    return 0


def chat_prompt(engine: LLMEngine, task: str) -> dict:
    """The task's text as one user message in the model's chat template."""
    tok = engine.tokenizer
    text, ids = tok.encode_chat([{"role": "user", "content": TASKS[task]}],
                                add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": ids}


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
             "| same tokens as the first mode |",
             "|------|------|-------------:|---------:|------------------:|----------------:"
             "|:-------------------:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['task']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{num(r['speedup'], '.2f')}x | {num(r['mean_acceptance_length'], '.2f')} | "
                     f"{num(r['acceptance_rate'], '.2f')} | "
                     f"{'yes' if r['same_tokens_as_first_mode'] else 'no'} |")
    return "\n".join(lines)
