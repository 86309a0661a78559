"""Garbage-collector pauses inside decode steps, with and without the start-up heap frozen
(tokenmill.utils.freeze_startup_heap, which `tokenmill serve`, `batch`, `stream` and the
offline benchmarks call once loaded). Each mode runs in a process of its own: an engine
decoding ``--batch`` sequences of ``--context`` tokens (tiny-llama, dummy weights, on the CPU),
every collection timed through ``gc.callbacks``, every step timed whole.

    python benchmarks/gc_pauses.py [--batch 256] [--context 1000] [--steps 150]
        [--result-file FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

CHILD = """
import gc, json, statistics, sys, time
from tokenmill import LLM
from tokenmill.bench.latency import start_decoding
from tokenmill.utils import freeze_startup_heap
batch, context, steps = (int(v) for v in sys.argv[1:4])
llm = LLM(model="tiny-llama", load_format="dummy", device="cpu", max_num_seqs=batch,
          max_model_len=context + steps + 64, num_kv_blocks=batch * ((context + steps) // 16 + 4),
          max_num_batched_tokens=max(8192, context + 1))
engine = llm.engine
frozen = freeze_startup_heap()
start_decoding(engine, batch, context, steps + 8, seed=0)
pauses, began = [], [0.0]
def timed(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        pauses.append((info["generation"], (time.perf_counter() - began[0]) * 1000))
gc.callbacks.append(timed)
times = []
for _ in range(steps):
    t = time.perf_counter()
    engine.step()
    times.append((time.perf_counter() - t) * 1000)
gc.callbacks.remove(timed)
times.sort()
print(json.dumps({
    "frozen_objects": frozen, "tracked_objects": len(gc.get_objects()),
    "step_ms_median": statistics.median(times), "step_ms_p99": times[int(0.99 * len(times))],
    "step_ms_max": times[-1],
    "collections": {f"gen{g}": {"count": sum(1 for gg, _ in pauses if gg == g),
                                "total_ms": sum(p for gg, p in pauses if gg == g),
                                "max_ms": max((p for gg, p in pauses if gg == g), default=0.0)}
                    for g in range(3)}}))
"""


def run_mode(freeze: bool, batch: int, context: int, steps: int) -> dict[str, Any]:
    env = dict(os.environ, TOKENMILL_GC_FREEZE="1" if freeze else "0",
               TOKENMILL_FUSED_DECODE="0")
    done = subprocess.run([sys.executable, "-c", CHILD, str(batch), str(context), str(steps)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternating")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    runs = []
    for r in range(a.rounds):
        for freeze in (False, True):
            res = run_mode(freeze, a.batch, a.context, a.steps)
            runs.append({"frozen": freeze, "round": r + 1, **res})
    rows = []
    for run in runs:
        c = run["collections"]
        rows.append(["frozen" if run["frozen"] else "not frozen", run["round"],
                     run["tracked_objects"], c["gen2"]["count"], c["gen2"]["max_ms"],
                     c["gen1"]["max_ms"], run["step_ms_median"], run["step_ms_p99"],
                     run["step_ms_max"]])
    print(markdown_table(["heap", "round", "objects the GC tracks", "full collections",
                          "longest full (ms)", "longest gen1 (ms)", "step median (ms)",
                          "step p99 (ms)", "step max (ms)"], rows))
    hw = hardware()
    print(hardware_line(hw))
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "hardware": hw, "batch": a.batch,
                                   "context": a.context, "steps": a.steps,
                                   "command": " ".join(["python", *sys.argv]), "runs": runs})


if __name__ == "__main__":
    main()
