"""The start-up heap frozen out of garbage collection (utils.freeze_startup_heap), in fresh
processes: the suite itself turns it off (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import gc, json
from tokenmill import LLM
from tokenmill.utils import freeze_startup_heap
llm = LLM(model="tiny-llama", load_format="dummy", device="cpu", max_model_len=256,
          num_kv_blocks=64)
before = len(gc.get_objects())
frozen = freeze_startup_heap()
out = llm.generate(["hello"] * 2)
print(json.dumps({"before": before, "frozen": frozen, "after": len(gc.get_objects()),
                  "freeze_count": gc.get_freeze_count(), "texts": len(out)}))
"""


def run(env_value: str) -> dict:
    import json

    env = dict(os.environ, TOKENMILL_GC_FREEZE=env_value)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_start_up_heap_leaves_the_collector_and_the_engine_still_runs() -> None:
    on = run("1")
    # The loaded engine is tens of thousands of objects; the collector then tracks few.
    assert on["before"] > 20_000 and on["frozen"] >= on["before"] // 2
    # (frozen objects that lose their last reference are still freed, so the count drops a little)
    assert on["after"] < on["before"] // 10 and on["freeze_count"] > 0.9 * on["frozen"]
    assert on["texts"] == 2
    off = run("0")
    assert off["frozen"] == 0 and off["freeze_count"] == 0 and off["after"] > 20_000
