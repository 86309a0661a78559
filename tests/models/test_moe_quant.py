"""The grouped MoE kernels: only the chosen experts run, in float, int8 and int4; quantized
experts stay close to float, through the model and the engine."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hf_checkpoints import Checkpoint
from paged import PagedKVCache, run_step
from test_models_parity import prompts
from test_moe_parity import make_moe_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.moe import grouped_moe, torch_moe
from tokenmill.models.moe import SparseMoeBlock, StackedExperts
from tokenmill.quant.experts import QuantizedExperts, quantize_experts
from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from tokenmill.quant.model import quantize_model, quantize_weight


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_moe_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_quant"))


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).split(inter)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def random_routing(tokens: int, experts: int, k: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    return torch.rand(tokens, k, generator=gen), ids


@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (7, 8, 2), (37, 6, 3), (5, 4, 4)])
def test_torch_moe_matches_a_per_token_reference(tokens: int, experts: int, k: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 32, generator=gen)
    w13 = torch.randn(experts, 2 * 24, 32, generator=gen) * 0.2
    w2 = torch.randn(experts, 32, 24, generator=gen) * 0.2
    weights, ids = random_routing(tokens, experts, k, seed=tokens)
    got = torch_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, reference_moe(x, w13, w2, weights, ids), atol=1e-5,
                               rtol=1e-5)


def test_grouped_moe_calls_each_chosen_expert_once_and_no_other() -> None:
    x = torch.randn(5, 16)
    ids = torch.tensor([[3, 1], [1, 6], [3, 6], [1, 3], [6, 1]])
    weights = torch.rand(5, 2)
    calls: list[tuple[str, int, int]] = []

    def product(kind: str, width: int):
        def run(expert: int, rows: torch.Tensor) -> torch.Tensor:
            calls.append((kind, expert, rows.shape[0]))
            return rows[:, :1].expand(-1, width) * (expert + 1)
        return run

    grouped_moe(x, product("gate_up", 8), product("down", 16), weights, ids, num_experts=8)
    # Expert 1: four tokens, expert 3: three, expert 6: three; experts 0, 2, 4, 5, 7 never.
    assert calls == [("gate_up", 1, 4), ("down", 1, 4), ("gate_up", 3, 3), ("down", 3, 3),
                     ("gate_up", 6, 3), ("down", 6, 3)]


def _logits(model: torch.nn.Module, ckpt: Checkpoint, seqs: list[list[int]]) -> torch.Tensor:
    cache = PagedKVCache.for_arch(ckpt.arch, num_blocks=32)
    out = run_step(model, cache, list(enumerate(seqs)))
    out += run_step(model, cache, [(i, [7 + i]) for i in range(len(seqs))])  # a decode step
    return torch.cat(out)


@pytest.mark.parametrize("method,module_type", [("int8", Int8WeightOnlyLinear),
                                                 ("int4", Int4WeightOnlyLinear)])
def test_quantize_model_quantizes_the_experts_per_expert(qwen3_moe: Checkpoint, method: str,
                                                          module_type: type) -> None:
    model = copy.deepcopy(qwen3_moe.model)
    summary = quantize_model(model, method)
    assert not summary.kept_float, summary.kept_float
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(isinstance(b.experts, QuantizedExperts) for b in blocks)
    assert not any(isinstance(m, StackedExperts) for m in model.modules())
    for b in blocks:
        assert len(b.experts.gate_up) == len(b.experts.down) == qwen3_moe.arch.num_experts
        assert all(isinstance(m, module_type) for m in [*b.experts.gate_up, *b.experts.down])
        assert b.gate.weight.dtype == torch.float32  # the router stays float
    assert torch.isfinite(_logits(model, qwen3_moe, [[3, 4, 5]])).all()


@pytest.mark.parametrize("method,tolerance", [("int8", 0.03), ("int4", 0.25)])
def test_quantized_experts_close_to_float(qwen3_moe: Checkpoint, method: str,
                                          tolerance: float) -> None:
    """Only the experts quantized (the rest float): the logits' error is theirs alone."""
    model = copy.deepcopy(qwen3_moe.model)
    kept: dict[str, str] = {}
    assert quantize_experts(model, lambda w: quantize_weight(w, None, method), kept) == 2
    assert not kept
    seqs = prompts(qwen3_moe.arch.vocab_size, (9, 20, 1), seed=11)
    want = _logits(qwen3_moe.model, qwen3_moe, seqs)
    got = _logits(model, qwen3_moe, seqs)
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert 0 < err <= tolerance, err
    assert F.cosine_similarity(got, want).min().item() >= 0.98


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_decode_step_runs_only_the_chosen_experts(qwen3_moe: Checkpoint, method: str) -> None:
    model = copy.deepcopy(qwen3_moe.model)
    quantize_model(model, method)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    chosen: list[torch.Tensor] = []
    block.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[1]))
    called: list[tuple[str, int]] = []
    for kind in ("gate_up", "down"):
        for e, module in enumerate(getattr(block.experts, kind)):
            module.register_forward_hook(
                lambda _m, _i, _o, kind=kind, e=e: called.append((kind, e)))
    cache = PagedKVCache.for_arch(qwen3_moe.arch, num_blocks=16)
    run_step(model, cache, [(0, prompts(qwen3_moe.arch.vocab_size, (12,), seed=12)[0])])
    chosen.clear()
    called.clear()
    run_step(model, cache, [(0, [5])])  # one token: top-2 of 8 experts
    (ids,) = chosen
    expected = sorted(int(e) for e in ids[0])
    assert len(expected) == qwen3_moe.arch.num_experts_per_tok
    assert sorted(called) == sorted((kind, e) for e in expected for kind in ("gate_up", "down"))


def test_engine_serves_int4_experts_and_then_a_float_request(qwen3_moe: Checkpoint) -> None:
    seqs = prompts(qwen3_moe.arch.vocab_size, (6, 14), seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    quantized = LLM(str(qwen3_moe.path), dtype="float32", quantization="int4",
                    max_model_len=128)
    model = quantized.engine.core.executor.runner.model
    assert any(isinstance(m, QuantizedExperts) for m in model.modules())
    outs = quantized.generate(seqs, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    again = quantized.generate(seqs, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_the_bound_moe_kernel_computes_the_experts(qwen3_moe: Checkpoint) -> None:
    """``Kernels.moe`` is what a StackedExperts calls once bound (the seam a fused CUDA kernel
    takes), once per sparse layer and step; the default is the grouped PyTorch path."""
    from dataclasses import replace

    from tokenmill.models.kernel_binding import TORCH_KERNELS, bind_kernels

    model = copy.deepcopy(qwen3_moe.model)
    calls: list[int] = []

    def counted(x, w13, w2, weights, ids):  # noqa: ANN001, ANN202
        calls.append(x.shape[0])
        return torch_moe(x, w13, w2, weights, ids)

    bind_kernels(model, kernels=replace(TORCH_KERNELS, name="counted", moe=counted))
    seqs = prompts(qwen3_moe.arch.vocab_size, (4, 6), seed=14)
    got = _logits(model, qwen3_moe, seqs)
    sparse = sum(qwen3_moe.arch.is_moe_layer(i) for i in range(qwen3_moe.arch.num_hidden_layers))
    assert calls == [10] * sparse + [2] * sparse  # the prompts' step, then the decode step
    assert torch.equal(got, _logits(qwen3_moe.model, qwen3_moe, seqs))
    assert TORCH_KERNELS.moe is torch_moe
