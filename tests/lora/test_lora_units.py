"""The LoRA pieces without a model: the scheduler's adapters per step and their rows' order,
the step's row runs, the prefix cache's salt."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.lora.layers import LoRAStep
from tokenmill.lora_request import LoRARequest
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

A, B = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")


def _request(rid: str, lora: LoRARequest | None, prompt_len: int = 8) -> Request:
    return Request(rid, [10 + i for i in range(prompt_len)],
                   SamplingParams(temperature=0, max_tokens=4), lora_request=lora)


def _scheduler(max_loras: int, prefix_caching: bool = False) -> Scheduler:
    kv = KVCacheManager(64, 4, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, 64,
                     max_loras=max_loras)


def test_one_adapter_a_step_and_rows_grouped() -> None:
    """max_loras 1: b's request waits while a's run; the base request joins them; rows are
    ordered base first, then by adapter."""
    sched = _scheduler(max_loras=1)
    for rid, lora in (("a1", A), ("b1", B), ("base", None), ("a2", A)):
        sched.add_request(_request(rid, lora))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["base", "a1", "a2"]
    assert [r.lora_request for r in out.new_requests] == [A, None, A]
    stats = sched.stats()  # for /metrics' lora_requests_info
    assert (stats.running_loras, stats.waiting_loras, stats.max_loras) == (("a",), ("b",), 1)


def test_two_adapters_a_step() -> None:
    sched = _scheduler(max_loras=2)
    for rid, lora in (("b1", B), ("a1", A), ("base", None)):
        sched.add_request(_request(rid, lora))
    assert list(sched.schedule().num_scheduled_tokens) == ["base", "a1", "b1"]


def test_engine_without_slots_refuses() -> None:
    with pytest.raises(ValueError, match="runs no LoRA adapters"):
        _scheduler(max_loras=0).add_request(_request("a1", A))


def test_prefix_hashes_are_salted_per_adapter() -> None:
    kv = KVCacheManager(64, 4)
    tokens = list(range(12))
    kv.set_salt("a", A.cache_salt)
    kv.set_salt("a-again", A.cache_salt)
    kv.set_salt("b", B.cache_salt)
    hashes = {rid: kv.block_hashes(rid, tokens, 3) for rid in ("a", "a-again", "b", "base")}
    assert hashes["a"] == hashes["a-again"]
    assert len({tuple(h) for h in hashes.values()}) == 3
    kv.forget("a")
    assert kv.block_hashes("a", tokens, 3) == hashes["base"]


def test_step_runs() -> None:
    """Neighbouring requests of one slot make one run; a slot in two places gets an index."""
    step = LoRAStep.from_row_slots([(0, 3, 1), (3, 1, 1), (6, 2, 0), (9, 1, 1)],
                                   torch.device("cpu"))
    assert step.runs == (1, 0, 4, 0, 6, 8, 1, 9, 10)
    groups = {g.slot: g for g in step.groups}
    assert (groups[0].start, groups[0].stop, groups[0].index) == (6, 8, None)
    assert groups[1].index.tolist() == [0, 1, 2, 3, 9]
    assert LoRAStep.from_row_slots([], torch.device("cpu")) is None
