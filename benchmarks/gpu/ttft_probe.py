"""Where a single stream's first token waits, step by step and asynchronously scheduled.

On an H200 (2026-11-27) the decode suite's median TTFT went from 14.9 ms to 26.5 ms with
asynchronous scheduling, where the prefill's token should only wait for the launch of the
first decode step. This runs single requests both ways in one process and prints, for the
median request, a timeline from ``add_request`` to the first token: every ``engine.step()``
call, every launch and every wait for a step's tokens (host clock, milliseconds).

    python benchmarks/gpu/ttft_probe.py --model llama-3.1-8b [--requests 7] [--result-file F]
    python benchmarks/gpu/ttft_probe.py --model embedded --device cpu   # the script itself
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.report import now_iso, write_json
from tokenmill.engine.output_processor import OutputKind
from tokenmill.runner.launched import LaunchedStep
from tokenmill.runner.model_runner import ModelRunner


class Timeline:
    """Events of one request, in ms since its add_request."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.events: list[tuple[float, str]] = []

    def mark(self, what: str) -> None:
        # New pinned host blocks so far: cudaHostAlloc, which may wait for the device, is one
        # suspect for the first token's wait.
        stats = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
        allocs = stats.get("num_host_alloc")
        note = "" if allocs is None else f"  (pinned allocations so far: {allocs})"
        self.events.append(((time.perf_counter() - self.t0) * 1000, what + note))


def instrument(timeline: Timeline) -> None:
    launch, finish = ModelRunner.launch, LaunchedStep.finish

    def timed_launch(runner: ModelRunner, *args: Any) -> LaunchedStep:
        timeline.mark("launch begins")
        step = launch(runner, *args)
        timeline.mark("launch returns")
        return step

    def timed_finish(step: LaunchedStep) -> Any:
        if step.sampled is None:
            return finish(step)
        timeline.mark("wait for tokens")
        out = finish(step)
        timeline.mark("tokens on the host")
        return out

    ModelRunner.launch = timed_launch  # type: ignore[method-assign]
    LaunchedStep.finish = timed_finish  # type: ignore[method-assign]


def one_request(llm: LLM, timeline: Timeline, prompt: list[int], rid: str) -> float:
    """TTFT in ms of one greedy request of 16 tokens; the timeline up to its first token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    timeline.events = []
    timeline.t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params, kind=OutputKind.DELTA)
    ttft = None
    while engine.has_unfinished_requests():
        timeline.mark("step() called")
        outs = engine.step()
        if ttft is None and any(c.token_ids for o in outs for c in o.outputs):
            ttft = (time.perf_counter() - timeline.t0) * 1000
            timeline.mark("FIRST TOKEN")
    assert ttft is not None
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=7)
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    timeline = Timeline()
    instrument(timeline)
    prompt = torch.randint(100, 20000, (a.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    results: dict[str, Any] = {}
    for mode in (False, True):
        # A preset's shape with dummy weights, or "embedded": the embedded model.
        model = {} if a.model == "embedded" else {"model": a.model, "load_format": "dummy"}
        llm = LLM(**model, device=a.device, max_model_len=1024, max_num_seqs=8,
                  async_scheduling=mode)
        runs = []
        for i in range(a.requests + 1):  # the first warms up
            ttft = one_request(llm, timeline, prompt, f"{mode}-{i}")
            runs.append((ttft, list(timeline.events)))
        runs = sorted(runs[1:], key=lambda r: r[0])
        ttft, events = runs[len(runs) // 2]
        name = "asynchronous" if mode else "step by step"
        results[name] = {"ttft_ms": [r[0] for r in runs], "ttft_ms_median": ttft,
                         "median_timeline": [e for e in events if e[0] <= ttft + 0.5]}
        print(f"\n{name}: TTFT median {ttft:.2f} ms of {[round(r[0], 1) for r in runs]}")
        for at, what in results[name]["median_timeline"]:
            print(f"  {at:8.2f} ms  {what}")
        llm.engine.close()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "model": a.model,
                                   "device": (torch.cuda.get_device_name(0)
                                              if a.device == "cuda" else "cpu"),
                                   "command": " ".join(["python", *sys.argv]),
                                   "results": results, "median_of": a.requests})


if __name__ == "__main__":
    main()
