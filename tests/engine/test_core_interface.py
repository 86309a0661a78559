"""EngineCore through the executor's public interface only, and its steps as data: a fake
executor with no runner and no model drives the core, and a registered step consumer gets
each step's StepStats (the engine's own accounting reads the same stats)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tokenmill.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.engine.core import EngineCore
from tokenmill.executor import ExecutorInfo, KVCachePlan, LaunchedStep, WeightTallies
from tokenmill.metrics.stats import StepStats
from tokenmill.model_loader import LoadedModel
from tokenmill.models.config import ArchConfig
from tokenmill.outputs import ComputeUsage
from tokenmill.request import Request
from tokenmill.runner.platform import get_platform
from tokenmill.sampling_params import SamplingParams

ARCH = ArchConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=16,
                  intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
TOKEN = 7  # what the fake "model" samples, every time


class FakeExecutor:
    """The executor's public interface and nothing else: no runner, no model to run."""

    def __init__(self) -> None:
        self.platform = get_platform("cpu")
        self.steps: list[dict[str, int]] = []  # each executed step's scheduled tokens
        self.kv_blocks: int | None = None
        self.lora_in_use: object = None
        self.closed = False

    @property
    def runner(self) -> object:
        raise AssertionError("EngineCore reached into the executor's runner")

    def load_model(self, loaded: LoadedModel | None = None) -> LoadedModel:
        tokenizer = SimpleNamespace(eos_token_ids=frozenset())
        return LoadedModel(model=nn.Identity(), arch=ARCH, tokenizer=tokenizer,  # type: ignore[arg-type]
                           path="fake")

    def plan_kv_cache(self, max_model_len: int) -> KVCachePlan:
        return KVCachePlan(num_blocks=64, block_size=4, bytes_per_block=1024,
                           max_model_len=max_model_len, dtype="float32", how="fake")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_blocks = num_blocks

    def capture_decode_graphs(self, max_model_len: int) -> bool:
        return False

    def describe(self) -> ExecutorInfo:
        return ExecutorInfo(dtype=torch.float32, attention_backend="fake")

    def weight_tallies(self) -> WeightTallies:
        return WeightTallies(num_parameters=11, weight_bytes=44, decode_read_bytes=40)

    def keep_loras_in_use(self, in_use: object) -> None:
        self.lora_in_use = in_use

    def execute(self, sched: SchedulerOutput,
                draft_probs: dict[str, torch.Tensor]) -> RunnerOutput:
        # Prompts fit the token budget: each scheduled request catches up and samples.
        self.steps.append(dict(sched.num_scheduled_tokens))
        return RunnerOutput(sampled_token_ids={rid: [TOKEN] for rid in sched.num_scheduled_tokens})

    def launch(self, sched: SchedulerOutput,
               draft_probs: dict[str, torch.Tensor]) -> LaunchedStep:
        return LaunchedStep(self.execute(sched, draft_probs))

    def close(self) -> None:
        self.closed = True


def make_core(async_scheduling: bool) -> tuple[EngineCore, FakeExecutor]:
    config = EngineConfig(
        model=ModelConfig(dtype="float32"), cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                  async_scheduling=async_scheduling),
        device=DeviceConfig(device="cpu"))
    executor = FakeExecutor()
    return EngineCore(config, executor=executor), executor  # type: ignore[arg-type]


def add(core: EngineCore, rid: str, prompt_len: int, max_tokens: int) -> None:
    prompt = [10 + i for i in range(prompt_len)]
    core.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                             eos_token_ids=frozenset()))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_core_steps_through_the_executor_interface_only(async_scheduling: bool) -> None:
    core, executor = make_core(async_scheduling)
    assert core.async_scheduling is async_scheduling
    assert executor.kv_blocks == 64 and executor.lora_in_use == core.scheduler.lora_in_use
    add(core, "a", prompt_len=5, max_tokens=3)
    add(core, "b", prompt_len=9, max_tokens=2)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finished = set()
    for _ in range(20):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(out.request_id)
    assert tokens == {"a": [TOKEN] * 3, "b": [TOKEN] * 2} and finished == {"a", "b"}
    info = core.model_info()
    assert (info.attention_backend, info.dtype, info.num_parameters) == ("fake", "float32", 11)
    assert info.decode_graph_sizes == () and info.kv_cache.num_blocks == 64
    core.close()
    assert executor.closed


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_registered_consumer_gets_each_steps_stats(async_scheduling: bool) -> None:
    core, executor = make_core(async_scheduling)
    seen: list[StepStats] = []
    core.add_step_consumer(seen.append)
    add(core, "a", prompt_len=5, max_tokens=3)
    add(core, "b", prompt_len=9, max_tokens=2)
    usage: dict[str, ComputeUsage] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finish_reason is not None:
                usage[out.request_id] = out.usage
    # One StepStats per step the executor ran, in order, with what each request computed.
    # (Asynchronous scheduling ends on an empty step, finished at once and never accounted.)
    steps = [step for step in executor.steps if step]
    assert [dict(s.num_scheduled_tokens) for s in seen] == steps
    assert steps[0] == {"a": 5, "b": 9} and len(steps) >= 3
    assert [(s.batch_size, s.num_batched_tokens) for s in seen] == [
        (len(step), sum(step.values())) for step in steps]
    assert all(s.seconds >= 0 and s.energy_joules >= 0 for s in seen)
    # The engine's accounting is a consumer of the same stats: its totals are theirs, and
    # the requests' usage (in their final outputs) adds up to them.
    totals = core.accountant.totals
    assert totals.compute_seconds == pytest.approx(sum(s.seconds for s in seen), rel=1e-9)
    assert totals.energy_joules == pytest.approx(sum(s.energy_joules for s in seen), rel=1e-9)
    charged = ComputeUsage.total(list(usage.values()))
    assert charged.compute_seconds == pytest.approx(totals.compute_seconds, rel=1e-9)
    # A consumer added later sees the steps from then on; the next request runs as before.
    later: list[StepStats] = []
    core.add_step_consumer(later.append)
    add(core, "c", prompt_len=3, max_tokens=1)
    outs = [o for _ in range(4) if core.has_unfinished_requests() for o in core.step()]
    assert [o.new_token_ids for o in outs if o.request_id == "c"] == [[TOKEN]]
    assert later and later == seen[-len(later):]
    assert [dict(s.num_scheduled_tokens) for s in later] == [{"c": 3}]
