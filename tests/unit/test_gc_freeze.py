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


UNLOAD = """
import argparse, asyncio, gc, weakref
from tokenmill.engine.args import add_engine_args, engine_config_from_args
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.utils import freeze_startup_heap
p = argparse.ArgumentParser()
add_engine_args(p)
config = engine_config_from_args(p.parse_args(
    ["--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
     "--max-model-len", "256", "--num-kv-blocks", "64"]))
async def serve_and_unload():
    engine = LLMEngine(config)
    client = AsyncLLM(engine)
    client.start()
    model = weakref.ref(engine.core.executor.runner.model)
    assert freeze_startup_heap() > 0
    await client.shutdown()
    engine.close()
    return model
model = asyncio.run(serve_and_unload())
gc.collect()
print("freed" if model() is None else "kept")
"""


def test_an_engine_loaded_before_the_freeze_is_freed_when_unloaded() -> None:
    """The admin API swaps models in a running server: an engine frozen with the start-up heap
    must still go once it is shut down (it is freed by reference counts, which freezing leaves
    alone; a reference cycle through it would keep it for good)."""
    done = subprocess.run([sys.executable, "-c", UNLOAD],
                          env=dict(os.environ, TOKENMILL_GC_FREEZE="1"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "freed"
