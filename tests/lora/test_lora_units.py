"""The LoRA pieces without a model: the scheduler's adapters per step and their rows' order,
the step's row runs, the prefix cache's salt."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.lora.layers import LoRALinear, LoRAStep, StepContext
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


def test_step_runs_and_masks() -> None:
    """Neighbouring requests of one slot make one run; several runs get masks that keep
    each row's own slot's columns."""
    step = LoRAStep.from_row_slots([(0, 3, 1), (3, 1, 1), (6, 2, 0), (9, 1, 1)], 10, 2,
                                   torch.device("cpu"))
    assert step.runs == (1, 0, 4, 0, 6, 8, 1, 9, 10)
    assert step.single is None
    assert step.row_slots.tolist() == [1, 1, 1, 1, -1, -1, 0, 0, -1, 1]
    mask = step.mask(2, torch.float32)  # 2 slots x width 2
    assert mask.tolist() == [[0, 0, 1, 1]] * 4 + [[0, 0, 0, 0]] * 2 + [[1, 1, 0, 0]] * 2 + [
        [0, 0, 0, 0], [0, 0, 1, 1]]
    one = LoRAStep.from_row_slots([(2, 3, 0), (5, 1, 0)], 8, 2, torch.device("cpu"))
    assert one.single == (0, 2, 6)
    assert LoRAStep.from_row_slots([], 4, 2, torch.device("cpu")) is None


def test_layer_paths_agree() -> None:
    """A LoRALinear's one-run product and its masked one give the per-row reference."""
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    context = StepContext()
    lora = LoRALinear(base, 6, (3, 2), max_loras=3, max_rank=2, dtype=torch.float32,
                      device=torch.device("cpu"), context=context)
    weights = {}
    for slot in range(3):
        for part, width in enumerate((3, 2)):
            a, b = torch.randn(2, 6), torch.randn(width, 2)
            lora.set_part(slot, part, a, b)
            weights[slot, part] = (a, b)
    x = torch.randn(7, 6)
    row_slot = [2, 2, None, 0, 0, 1, None]

    def reference(row: int) -> torch.Tensor:
        y = base(x[row])
        slot = row_slot[row]
        if slot is not None:
            y = y + torch.cat([weights[slot, p][1] @ (weights[slot, p][0] @ x[row])
                               for p in (0, 1)])
        return y

    context.step = LoRAStep.from_row_slots([(0, 2, 2), (3, 2, 0), (5, 1, 1)], 7, 3,
                                           torch.device("cpu"))
    torch.testing.assert_close(lora(x), torch.stack([reference(r) for r in range(7)]))
    row_slot = [None, 1, 1, 1, None, None, None]
    context.step = LoRAStep.from_row_slots([(1, 3, 1)], 7, 3, torch.device("cpu"))
    torch.testing.assert_close(lora(x), torch.stack([reference(r) for r in range(7)]))
