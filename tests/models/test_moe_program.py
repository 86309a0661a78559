"""Qwen3-MoE and Mixtral on the CPU op program: each sparse layer's feed-forward is one generic
``moe`` op (router, softmax top-k, the chosen experts' gate_up / silu_mul / down on their rows)
with float, int8 or int4 experts, equal to ``model.forward`` in prefill and decode steps of
one and several sequences; through the engine the greedy tokens stay transformers'."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hf_checkpoints import Checkpoint
from paged import PagedKVCache
from test_cpu_program import Counted, _eager_and_program
from test_fused_decode import decode_both, prefill
from test_models_parity import prompts
from test_moe_engine import greedy, hf_greedy
from test_moe_parity import make_moe_checkpoint

from tokenmill import LLM
from tokenmill.models.moe import SparseMoeBlock
from tokenmill.quant.experts import QuantizedExperts
from tokenmill.quant.model import quantize_weight
from tokenmill.runner.cpu_lowering_moe import Moe
from tokenmill.runner.cpu_program import CpuProgram, UnsupportedModel
from tokenmill.runner.step_backend import CpuProgramBackend


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_moe_sparse_step", "mixtral"])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_moe_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


# Families whose expert widths the int4 kernel takes (multiples of its group size, 32).
@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_int4(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_moe_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def sparse_blocks(model: torch.nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def test_each_sparse_layer_is_one_moe_op(moe: Checkpoint) -> None:
    program = CpuProgram(moe.model)
    ops = [op for op in program.ops if isinstance(op, Moe)]
    blocks = sparse_blocks(moe.model)
    assert len(ops) == len(blocks) > 0
    for op, block in zip(ops, blocks, strict=True):
        assert (op.top_k, op.renormalize) == (block.gate.top_k, block.gate.renormalize)
        assert op.router.weight is block.gate.weight
        assert len(op.gate_up) == len(op.down) == moe.arch.num_experts


def test_fp32_steps_match_model_forward(moe: Checkpoint) -> None:
    """Prompt steps (one and several sequences, chunks beside decodes) and 4-sequence decodes."""
    for eager, got, _ in _eager_and_program(moe.model, moe.arch, torch.float32):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, eager, rtol=0, atol=1e-4)


def test_single_sequence_decode_matches_model_forward(moe: Checkpoint) -> None:
    program = CpuProgram(moe.model)
    counted = Counted(program)
    cache = PagedKVCache.for_arch(moe.arch, num_blocks=16)
    prefill(moe.model, cache, (21,), moe.arch.vocab_size)
    other = cache.clone()
    for token in (3, 9, 27):
        eager, got = decode_both(moe.model, program, cache, other, [token])
        torch.testing.assert_close(got, eager, rtol=0, atol=1e-4)
    assert counted.calls == 3


def test_int8_experts_match_model_forward(moe: Checkpoint) -> None:
    _quantized_experts_match_model_forward(moe, "int8")


def test_int4_experts_match_model_forward(moe_int4: Checkpoint) -> None:
    _quantized_experts_match_model_forward(moe_int4, "int4")


def _quantized_experts_match_model_forward(moe: Checkpoint, method: str) -> None:
    """Only the experts quantized: the op runs each one's own int kernel, as the module does."""
    model = copy.deepcopy(moe.model)
    for block in sparse_blocks(model):
        block.experts = QuantizedExperts.from_stacked(
            block.experts, lambda w: quantize_weight(w, None, method))
    program = CpuProgram(model)
    assert any(op.gate_up[0].kind != 0 for op in program.ops if isinstance(op, Moe))
    # The same kernels on both sides; a last-bit difference in the fp32 glue may flip the bf16
    # rounding of a kernel's input (int4's decode steps quantize activations to 8 bits, which
    # such a flip moves further), hence more than fp32's tolerance: test_cpu_program's.
    atol = 0.15 if method == "int4" else 5e-2
    for eager, got, _ in _eager_and_program(model, moe.arch, torch.float32):
        torch.testing.assert_close(got, eager, rtol=0, atol=atol)


def test_experts_that_compute_more_are_refused(moe: Checkpoint) -> None:
    class BiasedExperts(type(sparse_blocks(moe.model)[0].experts)):
        def forward(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(x, w, ids) + 1

    model = copy.deepcopy(moe.model)
    block = sparse_blocks(model)[0]
    block.experts.__class__ = BiasedExperts
    with pytest.raises(UnsupportedModel, match="BiasedExperts"):
        CpuProgram(model)


def test_engine_runs_the_program_and_matches_transformers(
        moe: Checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        llm = LLM(str(moe.path), dtype="float32", quantization="none", max_model_len=256)
    runner = llm.engine.core.executor.runner
    assert isinstance(runner.step_backend, CpuProgramBackend)
    assert "step backend: cpu program" in caplog.text
    counted = Counted(runner.cpu_program)
    seqs = prompts(moe.arch.vocab_size, (3, 17, 40), seed=7)
    outputs = llm.generate(seqs, greedy(8))
    want = [hf_greedy(moe, p, 8)[0] for p in seqs]
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert counted.calls > 0
    # The next request, alone, is answered as before.
    again = llm.generate([seqs[0]], greedy(8))
    assert again[0].outputs[0].token_ids == want[0]


def test_bf16_as_close_to_fp32_as_model_forward(moe: Checkpoint) -> None:
    """bf16 rounds differently in the C++ glue (fp32 attention): both paths' distance to an
    fp32 run of the same bf16-rounded weights. A token whose top-k flips between two experts
    of near-equal logits is far off on either path (transformers' bf16 alike), at different
    tokens: so the typical token's error, the median over rows, is compared."""
    ref = copy.deepcopy(moe.model).to(torch.bfloat16).float()
    model = copy.deepcopy(moe.model).to(torch.bfloat16)
    for eager, got, want in _eager_and_program(model, moe.arch, torch.bfloat16, ref):
        assert got.dtype == torch.bfloat16
        err_eager = (eager.float() - want).abs().amax(dim=1).median().item()
        err_program = (got.float() - want).abs().amax(dim=1).median().item()
        assert err_program <= 2 * err_eager + 1e-2, (err_program, err_eager)
