"""`tokenmill bench latency`: one request at a time through the offline engine.

Each iteration sends one prompt of ``--input-len`` tokens (a fresh prompt every time, so no
prefix cache can help) and generates ``--output-len`` tokens, timing every token as it leaves
the engine: TTFT, prefill tokens/s (prompt tokens / TTFT), decode tokens/s ((output tokens - 1)
/ (e2e - TTFT)) and end-to-end latency, after warm-up iterations, with peak resident memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.offline import (
    add_offline_args,
    energy_line,
    energy_report,
    engine_facts,
    load_engine,
    sampling,
    workload,
)
from tokenmill.bench.report import hardware, now_iso, peak_rss_mib, write_json
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.output_processor import OutputKind
from tokenmill.metrics.summary import percentile


@dataclass
class Timing:
    """One single-stream request: prompt and output tokens and when they came (seconds)."""

    prompt_tokens: int
    output_tokens: int
    ttft: float
    e2e: float

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.ttft

    @property
    def decode_tps(self) -> float | None:
        if self.output_tokens < 2 or self.e2e <= self.ttft:
            return None
        return (self.output_tokens - 1) / (self.e2e - self.ttft)


def time_one(engine: LLMEngine, rid: str, req: SampleRequest, temperature: float) -> Timing:
    """Run one request alone and time its first and last token."""
    start = time.perf_counter()
    engine.add_request(rid, req.prompt, sampling(req, temperature), kind=OutputKind.DELTA)
    first = last = 0.0
    n_out = n_prompt = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = sum(len(c.token_ids) for c in out.outputs)
            if new:
                last = time.perf_counter()
                first = first or last
                n_out += new
                n_prompt = len(out.prompt_token_ids)
    return Timing(n_prompt, n_out, first - start, last - start)


def summarize_timings(timings: list[Timing]) -> dict[str, Any]:
    """Medians (the headline numbers) and spreads over the timed iterations."""
    def stats(values: list[float]) -> dict[str, float]:
        return {"mean": statistics.fmean(values), "median": statistics.median(values),
                "min": min(values), "max": max(values), "p90": percentile(values, 90),
                "p99": percentile(values, 99)}

    decode = [d for t in timings if (d := t.decode_tps) is not None]
    return {
        "prompt_tokens": timings[0].prompt_tokens, "output_tokens": timings[0].output_tokens,
        "ttft_ms": stats([t.ttft * 1000 for t in timings]),
        "e2e_ms": stats([t.e2e * 1000 for t in timings]),
        "prefill_tokens_per_s": statistics.median([t.prefill_tps for t in timings]),
        "decode_tokens_per_s": statistics.median(decode) if decode else None,
        "iterations": [asdict(t) for t in timings],
    }


def add_latency_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench latency`."""
    p = subparsers.add_parser("latency", help="single-request TTFT, prefill and decode speed",
                              description=__doc__.splitlines()[0])
    add_offline_args(p, input_len="500", output_len="128", num_prompts=None)
    p.add_argument("--num-iters", type=int, default=3, help="timed iterations")
    p.add_argument("--num-warmups", type=int, default=1, help="untimed iterations first")
    p.set_defaults(func=cmd_latency)


def cmd_latency(args: argparse.Namespace) -> int:
    """Run `tokenmill bench latency`."""
    if args.num_iters < 1 or args.num_warmups < 0:
        raise ValueError("--num-iters must be >= 1 and --num-warmups >= 0")
    engine, load_s = load_engine(args)
    requests = workload(engine, args, args.num_warmups + args.num_iters)
    for i in range(args.num_warmups):
        time_one(engine, f"warmup-{i}", requests[i], args.temperature)
    usage_before = engine.stats().usage_total
    timings = [time_one(engine, f"lat-{i}", requests[args.num_warmups + i], args.temperature)
               for i in range(args.num_iters)]
    result = summarize_timings(timings)
    result.update(energy_report(engine, usage_before, sum(t.output_tokens for t in timings)))
    result.update(peak_rss_mib=peak_rss_mib(), date=now_iso(), dataset=args.dataset,
                  num_iters=args.num_iters, num_warmups=args.num_warmups,
                  engine=engine_facts(engine, load_s), hardware=hardware(),
                  command=" ".join(["tokenmill", *sys.argv[1:]]))
    decode = result["decode_tokens_per_s"]
    print(f"prompt {result['prompt_tokens']} tokens, output {result['output_tokens']} tokens, "
          f"{args.num_iters} iterations (medians)")
    decode_text = f"{decode:.1f} tok/s" if decode else "- (one output token)"
    print(f"TTFT: {result['ttft_ms']['median']:.1f} ms   "
          f"prefill: {result['prefill_tokens_per_s']:.1f} tok/s   decode: {decode_text}")
    print(f"end-to-end: {result['e2e_ms']['median']:.1f} ms   "
          f"peak memory (RSS): {result['peak_rss_mib']:.0f} MiB")
    print(energy_line(result))
    if args.result_file:
        write_json(args.result_file, result)
    return 0


def prefill_steps(batch: int, prompt_tokens: int, budget: int) -> int:
    """Steps that chunked prefill takes to bring ``batch`` prompts of ``prompt_tokens`` in, at
    most, when each prefilled request decodes one token a step out of the same ``budget`` of
    tokens (the prompts' share shrinks as more of them decode): so no request decodes more
    tokens than this while the others still prefill. ValueError where the decodes would
    take the whole budget."""
    steps, decoding, done, left = 0, 0, 0, prompt_tokens
    while done < batch:
        room = budget - decoding
        if room <= 0:
            raise ValueError(f"a budget of {budget} tokens a step cannot prefill {batch} "
                             f"prompts while the first {decoding} decode")
        steps += 1
        finished = 0
        while room > 0 and done < batch:
            take = min(room, left)
            room, left = room - take, left - take
            if left == 0:
                done, finished, left = done + 1, finished + 1, prompt_tokens
        decoding += finished
    return steps


def start_decoding(engine: LLMEngine, batch: int, prompt_tokens: int, max_tokens: int,
                   seed: int, kind: OutputKind = OutputKind.DELTA) -> None:
    """Queue ``batch`` greedy requests of ``prompt_tokens`` random ids (eos ignored, outputs
    of ``kind``: streamed by default) and step until every one has its first token: the
    engine then runs ``max_tokens`` decode-only steps of ``batch`` sequences, which the step
    profilers time. (Each request may generate up to ``max_tokens`` more than the steps that
    prefill the batch, so that the first prefilled do not finish before the last start.)"""
    import torch

    from tokenmill.sampling_params import SamplingParams

    budget = engine.core.scheduler.config.max_num_batched_tokens
    params = SamplingParams(max_tokens=max_tokens + prefill_steps(batch, prompt_tokens, budget),
                            temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.tokenizer.vocab_size
    for i in range(batch):
        ids = torch.randint(100, vocab - 100, (prompt_tokens,), generator=gen).tolist()
        engine.add_request(f"p{seed}-{i}", {"prompt_token_ids": ids}, params, kind=kind)
    requests = engine.core.scheduler.requests
    mine = [f"p{seed}-{i}" for i in range(batch)]
    while not all(rid in requests and requests[rid].num_output_tokens for rid in mine):
        if any(rid not in requests for rid in mine):
            raise RuntimeError(
                f"a request finished before all {batch} had started decoding (preempted "
                "ones restart): the KV cache holds too few of these sequences at once")
        engine.step()


Side = TypeVar("Side")


def alternating_step_times(engine: LLMEngine, sides: Sequence[Side],
                           use: Callable[[Side], None], context: int, steps: int, rounds: int,
                           switch_every: int, settle: int) -> dict[Side, list[float]]:
    """Step times (s) of single-stream decodes under two configurations, ``sides``, swapped
    every ``switch_every`` steps of the same decodes (``use(side)`` switches to one), so that
    both see the same machine at the same moments: the A/B benchmarks' loop. Each round is a
    decode of ``steps`` tokens after a ``context``-token prompt, starting on the other side
    than the round before; the prompt's step and the first ``settle`` steps after each swap
    are not counted."""
    times: dict[Side, list[float]] = {side: [] for side in sides}
    for r in range(rounds):
        start_decoding(engine, 1, context, steps, seed=r)
        i = 0
        while engine.has_unfinished_requests():
            side = sides[(i // switch_every + r) % 2]
            use(side)
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if i > 0 and i % switch_every >= settle:
                times[side].append(dt)
            i += 1
    return times
