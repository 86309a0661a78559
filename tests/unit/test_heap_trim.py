"""The engine's heap trimming: after steps of more than one token, at most once an interval,
never after single-token steps; on in a CPU engine where glibc has malloc_trim."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine import heap as heap_module
from tokenmill.engine.heap import HeapTrimmer
from tokenmill.utils import malloc_trim


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trims_after_batched_steps_at_most_once_an_interval() -> None:
    calls: list[int] = []
    clock = _Clock()
    trimmer = HeapTrimmer(lambda pad: calls.append(pad) or 1, interval_s=1.0, clock=clock)
    trimmer.after_step(512)  # within the first interval: not yet
    assert calls == []
    clock.now += 1.0
    trimmer.after_step(1)  # a single token: never
    assert calls == []
    trimmer.after_step(32)
    assert calls == [0] and trimmer.trims == 1
    clock.now += 0.5
    trimmer.after_step(32)  # half an interval later: not again
    assert trimmer.trims == 1
    clock.now += 0.5
    trimmer.after_step(2)
    assert trimmer.trims == 2


def test_no_trimmer_for_a_gpu_engine() -> None:
    assert HeapTrimmer.for_device(is_cuda=True) is None


def test_a_cpu_engine_trims_while_it_serves_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    if malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    monkeypatch.setattr(heap_module, "TRIM_INTERVAL_S", 0.0)
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=32 << 20)
    trimmer = llm.engine.core._heap
    assert trimmer is not None and trimmer.trims == 0
    outs = llm.generate(["Hello there", "The capital of France is"],
                        SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert trimmer.trims > 0
