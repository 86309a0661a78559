"""What `bench throughput` and `bench latency` share: the engine, its workload, its facts."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from tokenmill.bench.datasets import SampleRequest, load_jsonl, random_requests
from tokenmill.engine.args import add_engine_args, engine_config_from_args
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import ComputeUsage
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import freeze_startup_heap


def add_offline_args(p: argparse.ArgumentParser, input_len: str, output_len: str,
                     num_prompts: int | None) -> None:
    """Engine options (as every command that starts an engine) plus the workload's."""
    add_engine_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random",
                   help="'random' or a JSONL file of {prompt | prompt_token_ids, output_len?}")
    g.add_argument("--input-len", default=input_len, help="prompt tokens: N or MIN:MAX (random)")
    g.add_argument("--output-len", default=output_len, help="output tokens: N or MIN:MAX")
    if num_prompts is not None:
        g.add_argument("--num-prompts", type=int, default=num_prompts, help="requests to send")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--result-file", default=None, help="write the result JSON here")


def load_engine(args: argparse.Namespace) -> tuple[LLMEngine, float]:
    """The engine of the command-line options and the seconds it took to load."""
    start = time.perf_counter()
    engine = LLMEngine(engine_config_from_args(args))
    load_s = time.perf_counter() - start
    freeze_startup_heap()  # as `tokenmill serve` does once loaded
    return engine, load_s


def workload(engine: LLMEngine, args: argparse.Namespace, num: int) -> list[SampleRequest]:
    """Random prompts of exact lengths in the engine's own tokenizer, or the JSONL file's."""
    if args.dataset == "random":
        return random_requests(engine.tokenizer, num, args.input_len, args.output_len, args.seed)
    return load_jsonl(args.dataset, num, args.output_len, args.seed, engine.tokenizer)


def sampling(req: SampleRequest, temperature: float) -> SamplingParams:
    """Exactly ``output_len`` tokens: EOS is ignored so every engine does the same work."""
    return SamplingParams(temperature=temperature, max_tokens=req.output_len, ignore_eos=True)


def engine_facts(engine: LLMEngine, load_s: float) -> dict[str, Any]:
    """What ran: model file, dtype, threads and the whole engine configuration."""
    import torch

    return {"model": engine.model_path, "dtype": engine.model_info().dtype,
            "threads": torch.get_num_threads(), "load_s": load_s,
            "config": dataclasses.asdict(engine.config)}


def warm_up(engine: LLMEngine, req: SampleRequest, num: int) -> None:
    """Run ``num`` short requests first: the first forward passes pay one-time set-up costs."""
    params = SamplingParams(temperature=0.0, max_tokens=min(req.output_len, 8), ignore_eos=True)
    for i in range(num):
        engine.add_request(f"warmup-{i}", req.prompt, params)
        while engine.has_unfinished_requests():
            engine.step()


def energy_report(engine: LLMEngine, before: ComputeUsage, output_tokens: int) -> dict[str, Any]:
    """Energy and cost of the engine steps since ``before`` (the engine's totals then), per
    1,000 output tokens; ``energy_estimated`` when no counter was read."""
    now = engine.stats().usage_total
    joules = now.energy_joules - before.energy_joules
    cost = now.cost_usd - before.cost_usd
    per_k = 1000 / output_tokens if output_tokens else 0.0
    return {"energy_joules": joules, "cost_usd": cost,
            "compute_seconds": now.compute_seconds - before.compute_seconds,
            "joules_per_1k_output_tokens": joules * per_k,
            "cost_usd_per_1k_output_tokens": cost * per_k,
            "energy_estimated": now.energy_estimated,
            "energy_sources": engine.core.accountant.meter.sources,
            "cpu_watts": engine.core.accountant.meter.cpu_watts}


def energy_line(report: dict[str, Any]) -> str:
    """One line for the terminal."""
    how = "estimated from CPU time" if report["energy_estimated"] else "measured"
    return (f"Energy: {report['joules_per_1k_output_tokens']:.1f} J per 1k output tokens "
            f"({how}), cost {report['cost_usd_per_1k_output_tokens']:.6f} USD per 1k")
