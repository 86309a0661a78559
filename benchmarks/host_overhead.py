"""The engine's own per-step work around the model: scheduling, building the step's inputs,
the sampler's host side, output processing. On a GPU this is time the device waits unless it
overlaps a running step (issue 19's profile: 1.0 ms of a 5.8 ms step at batch 1, 3.5 ms of
8.8 ms at batch 256 on an H200), so it is measured here on the CPU with a toy model whose
forward, logits and sampling calls are timed and subtracted from the step.

    python benchmarks/host_overhead.py [--batches 1,64,256] [--context 1000] [--steps 20]
        [--output-kind delta|final|cumulative] [--result-file FILE]

``--workload nano-vllm`` instead runs a whole workload (nano-vllm's: 256 requests, 100-1,024
tokens in and out, on Qwen3-0.6B's shape) with the model's forward pass, head and sampler
stubbed out: the seconds it takes are the engine's host work alone, and its tokens/s the most
the host allows on this CPU (a GPU's host does more: graph replays, copies to the device).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tokenmill import LLM
from tokenmill.bench.latency import start_decoding
from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json
from tokenmill.engine.output_processor import OutputKind
from tokenmill.runner.launched import SampledRows
from tokenmill.utils import freeze_startup_heap


class _Timer:
    """Wraps a callable and adds up the seconds spent in it."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds = fn, 0.0
        self.per_step: list[float] = []  # seconds in each timed step (see lap)

    def lap(self) -> None:
        """End a step: its seconds go to ``per_step``."""
        self.per_step.append(self.seconds - sum(self.per_step))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:
        """The wrapped object's other attributes, its methods timed into the same total (the
        sampler's greedy shortcut, ``Sampler.greedy``)."""
        attr = getattr(self.fn, name)
        if not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return timed


def measure(batch: int, context: int, steps: int,
            kind: OutputKind = OutputKind.DELTA) -> dict[str, float]:
    blocks = batch * (context // 16 + steps // 16 + 4) + 16
    llm = LLM(model="tiny-llama", load_format="dummy", device="cpu", max_num_seqs=batch,
              max_model_len=context + 2 * steps + 64, num_kv_blocks=blocks,
              max_num_batched_tokens=max(8192, context + 1))
    engine = llm.engine
    runner = engine.core.executor.runner
    timers = [_Timer(runner._forward), _Timer(runner.model.compute_logits),
              _Timer(runner.sampler)]
    runner._forward, runner.model.compute_logits, runner.sampler = timers
    # The host's phases (each includes none of the timed model calls except _sample's sampler
    # call and _prepare_inputs' none): schedule, inputs, sampling metadata, the sampled tokens
    # appended to the runner's requests, update, outputs.
    phases = {"schedule": _Timer(engine.core.scheduler.schedule),
              "prepare inputs": _Timer(runner._prepare_inputs),
              "sample (host part)": _Timer(runner._sample),
              "tokens to requests": _Timer(SampledRows.finish),
              "update": _Timer(engine.core.scheduler.update),
              "process outputs": _Timer(engine.processor.process)}
    engine.core.scheduler.schedule = phases["schedule"]
    runner._prepare_inputs = phases["prepare inputs"]
    runner._sample = phases["sample (host part)"]
    # A method of the class: wrapped in a function, so that it still binds its instance.
    finish_timer = phases["tokens to requests"]
    SampledRows.finish = lambda rows, out: finish_timer(rows, out)  # type: ignore[method-assign]
    engine.core.scheduler.update = phases["update"]
    engine.processor.process = phases["process outputs"]
    start_decoding(engine, batch, context, steps + 8, seed=0, kind=kind)
    freeze_startup_heap()  # as `tokenmill serve`, `batch` and the offline benchmarks do
    totals, hosts = [], []
    for t in [*phases.values(), *timers]:
        t.seconds = 0.0
    for _ in range(steps):
        before = sum(t.seconds for t in timers)
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        totals.append(total)
        hosts.append(total - (sum(t.seconds for t in timers) - before))
        for t in [*phases.values(), *timers]:
            t.lap()
    while engine.has_unfinished_requests():
        engine.step()
    SampledRows.finish = finish_timer.fn  # type: ignore[method-assign]
    # Medians of each phase over the steps (a collector's pause in one step would swing a mean).
    sampler = timers[2].per_step
    phases["sample (host part)"].per_step = [
        s - t for s, t in zip(phases["sample (host part)"].per_step, sampler, strict=True)]
    per_step = {name: statistics.median(t.per_step) * 1000 for name, t in phases.items()}
    return {"step_ms": statistics.median(totals) * 1000,
            "host_ms": statistics.median(hosts) * 1000, "phases_ms": per_step}


# --workload: name -> (model preset, requests, prompt lengths, output lengths), as
# `tokenmill bench gpu` runs them.
WORKLOADS = {"nano-vllm": ("qwen3-0.6b", 256, "100:1024", "100:1024")}


def host_only_run(workload: str) -> dict[str, Any]:
    """``workload`` through the engine with the forward pass, head and sampler stubbed out
    (zeros: every sampled token is id 0, and EOS is ignored as the benchmarks do)."""
    import torch

    from tokenmill.bench.datasets import random_requests
    from tokenmill.bench.throughput import run_throughput
    from tokenmill.runner.sampler import SamplerOutput

    model, num, input_len, output_len = WORKLOADS[workload]
    llm = LLM(model=model, load_format="dummy", device="cpu", max_num_seqs=256,
              max_model_len=2048, num_kv_blocks=256 * 2048 // 16, max_num_batched_tokens=8192)
    engine = llm.engine
    runner = engine.core.executor.runner
    rows = 8192
    hidden, logits = torch.zeros(rows, 8), torch.zeros(rows, 8)
    ids, logprobs = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows)
    runner._forward = lambda inputs: hidden[:inputs.input_ids.shape[0]]
    runner._compute_logits = lambda h: logits[:h.shape[0]]
    runner.sampler.greedy = lambda lg: SamplerOutput(sampled_token_ids=ids[:lg.shape[0]],
                                                     chosen_logprobs=logprobs[:lg.shape[0]])
    requests = random_requests(engine.tokenizer, num, input_len, output_len, seed=0)
    freeze_startup_heap()
    r = run_throughput(engine, requests, 0.0, progress=False)
    return {"workload": workload, "model": model, "steps": r["engine_steps"],
            "host_s": r["elapsed_s"], "output_tokens": r["total_output_tokens"],
            "host_ceiling_out_tok_s": r["output_tokens_per_s"],
            "host_ms_per_step": r["ms_per_step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--output-kind", choices=[k.value for k in OutputKind],
                    default=OutputKind.DELTA.value,
                    help="how the requests' outputs are reported: delta (streamed, the "
                         "server's streams), final (LLM.generate, batch jobs)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                    help="run this workload host-only instead (see the module's notes)")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    if a.workload:
        r = host_only_run(a.workload)
        print(markdown_table(["workload", "steps", "host s", "host ms per step",
                              "out tok/s the host allows"],
                             [[f"{r['workload']} ({r['model']})", r["steps"], r["host_s"],
                               r["host_ms_per_step"], r["host_ceiling_out_tok_s"]]]))
        hw = hardware()
        print(hardware_line(hw))
        if a.result_file:
            write_json(a.result_file, {"created": now_iso(), "hardware": hw, **r})
        return
    kind = OutputKind(a.output_kind)
    results = {}
    for b in (int(x) for x in a.batches.split(",")):
        results[str(b)] = measure(b, a.context, a.steps, kind)
    print(markdown_table(["batch", f"step ms (context {a.context})", "host ms per step",
                          "host us per sequence"],
                         [[b, r["step_ms"], r["host_ms"], r["host_ms"] * 1000 / int(b)]
                          for b, r in results.items()]))
    names = list(next(iter(results.values()))["phases_ms"])
    print(markdown_table(["batch", *[f"{n} ms" for n in names]],
                         [[b, *[r["phases_ms"][n] for n in names]] for b, r in results.items()]))
    hw = hardware()
    print(hardware_line(hw))
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "hardware": hw, "context": a.context,
                                   "output_kind": kind.value,
                                   "steps": a.steps, "results": results})


if __name__ == "__main__":
    main()
