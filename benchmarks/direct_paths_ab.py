"""Single-stream decode with the fused decoder's token embedding and logits taken straight from
the C++ kernels (the default for an int8 table and head) against the modules' own Python paths
(the same bits), in one process: the two are swapped every few steps of the same decodes, so
both sides see the same machine at the same moments.

    python benchmarks/direct_paths_ab.py [--context 500] [--steps 400] [--rounds 4]
        [--result-file FILE]
"""

from __future__ import annotations

import argparse
import statistics

from tokenmill import LLM
from tokenmill.bench.latency import alternating_step_times
from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json

SWITCH_EVERY = 10  # steps on one side before the swap
SETTLE = 2  # steps after each swap that are not counted


def ab(llm: LLM, context: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """Step times (s) on the direct paths and on the modules' paths."""
    engine = llm.engine
    runner = engine.core.executor.runner
    fused = runner.cpu_program
    if fused is None or fused._head is None:
        raise SystemExit("this model's fused decoder has no direct head: nothing to compare")
    sides = {"direct": (fused._embed, fused._head),
             "modules": (runner.model.model.embed_tokens, None)}

    def use(name: str) -> None:
        fused._embed, fused._head = sides[name]

    try:
        return alternating_step_times(engine, list(sides), use, context, steps, rounds,
                                      SWITCH_EVERY, SETTLE)
    finally:
        use("direct")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    llm = LLM(max_model_len=a.context + a.steps + 64, max_num_seqs=1)
    ab(llm, 32, 40, 1)  # warm-up
    times = ab(llm, a.context, a.steps, a.rounds)
    ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    gain = ms["modules"] / ms["direct"] - 1
    print(markdown_table(
        ["prompt tokens", "modules' paths ms/step", "direct ms/step", "modules tok/s",
         "direct tok/s", "gain"],
        [[a.context, f"{ms['modules']:.3f}", f"{ms['direct']:.3f}",
          f"{1e3 / ms['modules']:.1f}", f"{1e3 / ms['direct']:.1f}", f"{gain:+.1%}"]]))
    print(f"\n{hardware_line(hardware())}")
    if a.result_file:
        write_json(a.result_file, {
            "created": now_iso(), "hardware": hardware(), "context": a.context,
            "steps": a.steps, "rounds": a.rounds, "switch_every": SWITCH_EVERY,
            "modules_step_ms": ms["modules"], "direct_step_ms": ms["direct"], "gain": gain,
            "steps_each": {name: len(v) for name, v in times.items()},
            "command": "python benchmarks/direct_paths_ab.py --context "
                       f"{a.context} --steps {a.steps} --rounds {a.rounds}"})


if __name__ == "__main__":
    main()
