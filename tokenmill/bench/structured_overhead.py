"""What constrained decoding costs: the same prompts and the same output lengths, with a JSON
schema and without one, alternated in one engine (part of `tokenmill bench structured`).

A calibration run with the schemas learns each request's output length (greedy, so every round
repeats it). The unconstrained runs then ask for exactly those lengths (``ignore_eos``), so both
modes prefill the same prompts and decode the same number of tokens at the same batch sizes:
what differs is the grammar work (bitmask fill and apply, matcher advance). The order flips each
round (AB, BA, ...) so a slow drift of the machine lands on both modes alike.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.structured_set import SchemaCase, score_output
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.output_processor import OutputKind
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass
class Wave:
    """Requests run together: wall time, and per request its timings, tokens and text."""

    wall_s: float
    ttft_s: list[float]
    e2e_s: list[float]
    tokens: list[int]
    texts: list[str]
    finish_reasons: list[str | None]

    @property
    def output_tokens(self) -> int:
        return sum(self.tokens)

    def tpot_ms(self) -> list[float]:
        """Time per output token after the first, per request with two tokens or more."""
        return [(e - t) * 1000 / (n - 1)
                for t, e, n in zip(self.ttft_s, self.e2e_s, self.tokens, strict=True) if n > 1]


@dataclass
class ModeRuns:
    """Every timed run of one mode (constrained or not) at one batch size."""

    walls_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)

    def add(self, waves: list[Wave]) -> None:
        self.walls_s.append(sum(w.wall_s for w in waves))
        self.tokens.append(sum(w.output_tokens for w in waves))
        self.tpot_ms.append(statistics.median(t for w in waves for t in w.tpot_ms()))

    def summary(self) -> dict[str, Any]:
        tps = [n / s for n, s in zip(self.tokens, self.walls_s, strict=True)]
        return {"wall_s": self.walls_s, "output_tokens": self.tokens,
                "best_wall_s": min(self.walls_s), "median_wall_s": statistics.median(self.walls_s),
                "best_tokens_per_s": max(tps), "median_tokens_per_s": statistics.median(tps),
                "median_tpot_ms": statistics.median(self.tpot_ms), "tpot_ms": self.tpot_ms}


def run_wave(engine: LLMEngine, prompts: list[dict[str, Any]],
             params: list[SamplingParams], tag: str) -> Wave:
    """Add every prompt at once and step the engine until all are done, timing each token."""
    n = len(prompts)
    start = time.perf_counter()
    ids = {f"{tag}-{i}": i for i in range(n)}
    for rid, i in ids.items():
        engine.add_request(rid, prompts[i], params[i], kind=OutputKind.DELTA)
    ttft, e2e = [0.0] * n, [0.0] * n
    tokens, texts = [0] * n, [""] * n
    reasons: list[str | None] = [None] * n
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = ids[out.request_id]
            new = sum(len(c.token_ids) for c in out.outputs)
            if new:
                e2e[i] = time.perf_counter() - start
                ttft[i] = ttft[i] or e2e[i]
                tokens[i] += new
                texts[i] += out.outputs[0].text
            if out.finished:
                reasons[i] = out.outputs[0].finish_reason
    return Wave(time.perf_counter() - start, ttft, e2e, tokens, texts, reasons)


def chat_prompts(engine: LLMEngine, cases: list[SchemaCase]) -> list[dict[str, Any]]:
    """Each case's prompt as one user message in the model's chat template."""
    prompts = []
    for case in cases:
        text, ids = engine.tokenizer.encode_chat([{"role": "user", "content": case.prompt}])
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts


def constrained_params(cases: list[SchemaCase], max_tokens: int) -> list[SamplingParams]:
    """Greedy, each request held to its case's schema."""
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                           structured_outputs=StructuredOutputsParams(json=c.schema))
            for c in cases]


def free_params(lengths: list[int]) -> list[SamplingParams]:
    """Greedy, no schema, exactly ``lengths[i]`` tokens each."""
    return [SamplingParams(temperature=0.0, max_tokens=max(n, 1), ignore_eos=True)
            for n in lengths]


def measure_batch(engine: LLMEngine, cases: list[SchemaCase], batch: int, rounds: int,
                  max_tokens: int) -> dict[str, Any]:
    """Constrained vs unconstrained at one batch size; ``cases`` are run ``batch`` at a time."""
    prompts = chat_prompts(engine, cases)
    waves_of = [list(range(i, min(i + batch, len(cases)))) for i in range(0, len(cases), batch)]

    def run(params: list[SamplingParams], tag: str) -> list[Wave]:
        return [run_wave(engine, [prompts[i] for i in w], [params[i] for i in w], f"{tag}-{k}")
                for k, w in enumerate(waves_of)]

    c_params = constrained_params(cases, max_tokens)
    # Calibration: compiles the grammars (the cache keeps them), learns the output lengths.
    start = time.perf_counter()
    first = run(c_params, f"b{batch}-cal")
    first_wall = time.perf_counter() - start
    lengths = [n for w in first for n in w.tokens]
    texts = [t for w in first for t in w.texts]
    reasons = [r for w in first for r in w.finish_reasons]
    u_params = free_params(lengths)
    run(u_params, f"b{batch}-warm")  # the unconstrained path's first run pays set-up too
    modes = {"constrained": ModeRuns(), "unconstrained": ModeRuns()}
    mismatched = 0
    for r in range(rounds):
        order = ["constrained", "unconstrained"] if r % 2 == 0 else ["unconstrained", "constrained"]
        for mode in order:
            params = c_params if mode == "constrained" else u_params
            waves = run(params, f"b{batch}-{mode}-{r}")
            got = [n for w in waves for n in w.tokens]
            mismatched += sum(a != b for a, b in zip(got, lengths, strict=True))
            modes[mode].add(waves)
    c, u = modes["constrained"], modes["unconstrained"]
    paired = [cw / uw - 1 for cw, uw in zip(c.walls_s, u.walls_s, strict=True)]
    verdicts = [score_output(t, case.schema) for t, case in zip(texts, cases, strict=True)]
    return {
        "batch_size": batch, "requests": len(cases), "rounds": rounds, "max_tokens": max_tokens,
        "output_lengths": lengths, "length_mismatches": mismatched,
        "first_constrained_wall_s": first_wall,
        "constrained": c.summary(), "unconstrained": u.summary(),
        "overhead_median_pct": 100 * statistics.median(paired),
        "overhead_best_pct": 100 * (min(c.walls_s) / min(u.walls_s) - 1),
        "overhead_paired_pct": [100 * p for p in paired],
        "tpot_overhead_median_pct": 100 * (c.summary()["median_tpot_ms"]
                                           / u.summary()["median_tpot_ms"] - 1),
        "valid": sum(v.valid for v in verdicts), "finish_reasons": reasons,
        "invalid": [{"name": case.name, "error": v.error, "text": t[:300]}
                    for v, case, t in zip(verdicts, cases, texts, strict=True) if not v.valid],
    }


def measure_overhead(engine: LLMEngine, cases: list[SchemaCase], batch_sizes: list[int],
                     rounds: int, batch1_requests: int, max_tokens: int,
                     log: Any = print) -> list[dict[str, Any]]:
    """`measure_batch` for each batch size: batch 1 runs ``batch1_requests`` cases one after
    another, a batch of B runs B requests at once (the cases repeated to fill it)."""
    results = []
    for b in batch_sizes:
        n = batch1_requests if b == 1 else b
        chosen = [cases[i % len(cases)] for i in range(n)]
        log(f"overhead: batch {b}, {n} requests, {rounds} rounds")
        results.append(measure_batch(engine, chosen, b, rounds, max_tokens))
    return results
