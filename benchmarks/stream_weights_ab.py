"""Single-stream decode with the CPU kernels' weights fetched non-temporally (prefetchnta, the
default for models larger than the last-level cache) against the normal fetch (prefetcht0), in
one process: the switch is flipped every few steps of the same decodes, so both sides see the
same machine at the same moments.

    python benchmarks/stream_weights_ab.py [--contexts 100,500] [--steps 400] [--rounds 4]
        [--result-file FILE]
"""

from __future__ import annotations

import argparse
import statistics

from tokenmill import LLM
from tokenmill.bench.latency import alternating_step_times
from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json
from tokenmill.kernels.cpu import load_extension

SWITCH_EVERY = 25  # steps on one side before the switch flips
SETTLE = 3  # steps after each flip that are not counted


def ab(llm: LLM, context: int, steps: int, rounds: int) -> dict[bool, list[float]]:
    """Step times (s) with streaming on (True) and off (False), over ``rounds`` decodes of
    ``steps`` tokens after a ``context``-token prompt."""
    ext, engine = load_extension(), llm.engine
    was = ext.stream_weights()
    try:
        return alternating_step_times(engine, [True, False], ext.set_stream_weights, context,
                                      steps, rounds, SWITCH_EVERY, SETTLE)
    finally:
        ext.set_stream_weights(was)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="100,500")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    llm = LLM(max_model_len=max(contexts) + a.steps + 64, max_num_seqs=1)
    ab(llm, 32, 40, 1)  # warm-up
    rows, results = [], {}
    for context in contexts:
        times = ab(llm, context, a.steps, a.rounds)
        off = statistics.median(times[False]) * 1000
        on = statistics.median(times[True]) * 1000
        results[str(context)] = {"normal_step_ms": off, "streamed_step_ms": on,
                                 "normal_tok_s": 1000 / off, "streamed_tok_s": 1000 / on,
                                 "steps_each": [len(times[False]), len(times[True])]}
        rows.append([context, off, on, 1000 / off, 1000 / on, f"{off / on - 1:+.1%}"])
    print(markdown_table(["prompt tokens", "normal fetch ms/step", "streamed ms/step",
                          "normal tok/s", "streamed tok/s", "gain"], rows))
    hw = hardware()
    print(f"\n{hardware_line(hw)}")
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "hardware": hw, "steps": a.steps,
                                   "rounds": a.rounds, "switch_every": SWITCH_EVERY,
                                   "results": results})


if __name__ == "__main__":
    main()
