"""The engine's own per-step work around the model: scheduling, building the step's inputs,
the sampler's host side, output processing. On a GPU this is time the device waits unless it
overlaps a running step (issue 19's profile: 1.0 ms of a 5.8 ms step at batch 1, 3.5 ms of
8.8 ms at batch 256 on an H200), so it is measured here on the CPU with a toy model whose
forward, logits and sampling calls are timed and subtracted from the step.

    python benchmarks/host_overhead.py [--batches 1,64,256] [--context 1000] [--steps 20]
        [--output-kind delta|final|cumulative] [--result-file FILE]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--output-kind", choices=[k.value for k in OutputKind],
                    default=OutputKind.DELTA.value,
                    help="how the requests' outputs are reported: delta (streamed, the "
                         "server's streams), final (LLM.generate, batch jobs)")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
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
