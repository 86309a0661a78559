"""One seam for a step: the platform picks one step backend per engine at start, the runner
gives a step to it where it ``supports`` the step and to ``model.forward`` otherwise, and an
error inside the backend's forward reaches the caller (no silent fallback at run time)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.runner.flat_batch import FlatBatch
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.platform import Platform
from tokenmill.runner.step_backend import (
    CpuProgramBackend,
    CudaGraphBackend,
    EagerBackend,
    InvariantCpuProgramBackend,
    ModelStep,
    StepBackend,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [11, 12, 13, 14]}, {"prompt_token_ids": [21, 22]}]


def _tiny_llm(**kwargs: object) -> LLM:
    # No prefix caching: the runner-level steps below write KV into free blocks, which a
    # later request must never read as a cached prefix.
    return LLM(model="tiny-llama", load_format="dummy", num_kv_blocks=64, max_model_len=256,
               max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False,
               **kwargs)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return _tiny_llm()


def _runner(llm: LLM) -> ModelRunner:
    return llm.engine.core.executor.runner


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _prompt_step(runner: ModelRunner) -> SimpleNamespace:
    """A prompt of 5 tokens in the last KV blocks, shaped as the StepInputs _forward reads."""
    batch = FlatBatch(runner.block_size)
    last = runner.kv_caches[0].shape[1] - 1
    batch.add([5, 6, 7, 8, 9], 0, [last])
    input_ids, positions, meta = batch.build(runner.backend, runner.kv_caches, runner.device)
    return SimpleNamespace(input_ids=input_ids, positions=positions, attn_meta=meta)


# ------------------------------------------------------------------ the platform's choice


def test_cpu_default_is_the_cpu_program_and_the_start_logs_it(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tokenmill.runner.model_runner"):
        llm = _tiny_llm()
    runner = _runner(llm)
    backend = runner.step_backend
    assert type(backend) is CpuProgramBackend and runner.cpu_program is backend.program
    assert runner.decode_graphs is None
    lines = [r.getMessage() for r in caplog.records if "step backend" in r.getMessage()]
    assert lines == [f"step backend: {backend.describe()}"]
    assert "cpu program: decode and prefill steps" in lines[0]
    assert "steps with LoRA rows before adapters are attached" in lines[0]


def test_cpu_program_off_tensor_parallel_and_encoder_are_eager(llm: LLM) -> None:
    platform = Platform(torch.device("cpu"))
    eager = EagerBackend(_runner(llm).model)
    assert platform.step_backend(eager, cpu_program=False) is eager
    assert platform.step_backend(eager, tensor_parallel_size=2) is eager
    assert platform.step_backend(eager, is_encoder=True, deterministic=True) is eager
    assert type(platform.step_backend(eager)) is CpuProgramBackend
    # On CUDA the CPU program never runs: eager until the decode graphs are captured.
    assert platform.step_backend(eager) is not eager
    assert Platform(torch.device("cuda")).step_backend(eager) is eager


def test_deterministic_picks_the_invariant_cpu_program() -> None:
    det = _tiny_llm(quantization="int8", deterministic=True)
    backend = _runner(det).step_backend
    assert type(backend) is InvariantCpuProgramBackend
    assert "deterministic" in backend.describe()


def test_deterministic_refuses_a_float_model_at_start(llm: LLM) -> None:
    eager = EagerBackend(_runner(llm).model)
    with pytest.raises(ValueError, match="deterministic needs int8 or int4 weights"):
        Platform(torch.device("cpu")).step_backend(eager, deterministic=True)


def test_decode_graphs_by_device_and_enforce_eager() -> None:
    graphs_ok = SimpleNamespace(supports_cuda_graphs=True)
    cuda = Platform(torch.device("cuda"))
    assert cuda.captures_decode_graphs(graphs_ok, enforce_eager=False)
    assert not cuda.captures_decode_graphs(graphs_ok, enforce_eager=True)
    assert not cuda.captures_decode_graphs(SimpleNamespace(), enforce_eager=False)
    assert not Platform(torch.device("cpu")).captures_decode_graphs(graphs_ok, False)


def test_captured_graphs_become_the_step_backend() -> None:
    """With the fake capture of tests/unit/test_cuda_graphs.py: decode steps of the captured
    sizes replay a graph; prompt steps and steps with LoRA rows are not the graphs'."""
    pytest.importorskip("triton")
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.lora.layers import LoRAStep
    from tokenmill.runner.cuda_graphs import EagerReplay

    want = _tokens(_tiny_llm())
    llm = _tiny_llm()
    runner = _runner(llm)
    runner.backend = TritonAttentionBackend(decode_partition_size=32)
    runner.cpu_program = None
    assert runner.step_backend is runner.eager
    runner.capture_decode_graphs(4, llm.engine.core.max_model_len, capturer=EagerReplay())
    backend = runner.step_backend
    assert type(backend) is CudaGraphBackend and runner.decode_graphs is backend.graphs
    assert "cuda graphs: decode-only steps of up to 4 sequences" in backend.describe()
    inputs = _prompt_step(runner)
    prompt = ModelStep(inputs.input_ids, inputs.positions, inputs.attn_meta)
    assert not backend.supports(prompt)
    batch = FlatBatch(runner.block_size)
    for seq in range(3):
        batch.add([7], 3, [seq + 1])
    ids, positions, meta = batch.build(runner.backend, runner.kv_caches, runner.device)
    assert backend.supports(ModelStep(ids, positions, meta))
    lora = LoRAStep([[0, 0, 1]], 3, 1, runner.device)
    assert not backend.supports(ModelStep(ids, positions, meta, lora))
    assert _tokens(llm) == want


# ------------------------------------------------------------------ one call per step


class _Refusing(StepBackend):
    """Supports no step; running one would be a bug of the runner."""

    name = "refusing"

    def __init__(self, eager: EagerBackend) -> None:
        self.eager = eager
        self.asked = 0

    def supports(self, step: ModelStep) -> bool:
        self.asked += 1
        return False

    def forward(self, step: ModelStep) -> torch.Tensor:
        raise AssertionError("the runner ran a step its backend does not support")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.eager.logits(hidden)

    def describe(self) -> str:
        return "refusing: no step"


def test_an_unsupported_step_runs_eagerly(llm: LLM) -> None:
    runner = _runner(llm)
    saved = runner.step_backend
    runner.cpu_program = None
    want = _tokens(llm)
    refusing = _Refusing(runner.eager)
    try:
        runner.step_backend = refusing
        got = _tokens(llm)
    finally:
        runner.step_backend = saved
    assert refusing.asked > 0 and got == want


class _Broken:
    """A CPU program whose every step fails."""

    lora = False
    prefill = True

    def supports(self, *args: object) -> bool:
        return True

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("boom")


def test_an_error_in_the_backend_reaches_the_caller(llm: LLM) -> None:
    """The CPU program's error is the step's error (before, the runner caught it, switched to
    model.forward for good and said so only in a warning); the next request, on the
    engine's own backend again, gets the tokens it got before."""
    runner = _runner(llm)
    saved = runner.cpu_program
    assert saved is not None
    before = _tokens(llm)
    inputs = _prompt_step(runner)
    try:
        runner.cpu_program = _Broken()
        with pytest.raises(RuntimeError, match="boom"), torch.inference_mode():
            runner._forward(inputs)
    finally:
        runner.cpu_program = saved
    assert runner.cpu_program is saved
    assert _tokens(llm) == before


def test_deterministic_backend_refuses_an_unsupported_step(llm: LLM) -> None:
    """Every step is the invariant backend's (an eager one would round rows differently):
    one its program cannot run is an error naming why, not an eager step."""
    runner = _runner(llm)
    program = SimpleNamespace(supports=lambda ids, meta: False, lora=False, prefill=True)
    backend = InvariantCpuProgramBackend(program)  # type: ignore[arg-type]
    inputs = _prompt_step(runner)
    step = ModelStep(inputs.input_ids, inputs.positions, inputs.attn_meta)
    assert backend.supports(step)
    with pytest.raises(RuntimeError, match="deterministic: the CPU program cannot run this "
                                           r"step \(5 tokens of 1 sequences"):
        backend.forward(step)
