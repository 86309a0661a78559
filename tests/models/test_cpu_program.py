"""The CPU op program lowered from the module tree: Qwen3 (q/k norms) on it, a family defined
only here gets it with no code of its own, and a block it does not know is refused at load."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_checkpoints import Checkpoint, make_checkpoint, randomize
from paged import PagedKVCache
from test_fused_decode import (
    PREFILL_STEPS,
    PROMPT_LENS,
    decode_both,
    dequantized_copy,
    prefill,
    prefill_both,
    quantized_copy,
)
from torch import nn

from tokenmill.models import layers, registry
from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.runner.cpu_lowering import Attention, Linear, RopeStoreKV
from tokenmill.runner.cpu_program import CpuProgram, UnsupportedModel, make_cpu_program


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_program"))


class Counted:
    """Counts the C++ program's forward calls of a CpuProgram."""

    def __init__(self, program: CpuProgram) -> None:
        self.calls = 0
        inner = program.program

        def forward(*args: object) -> torch.Tensor:
            self.calls += 1
            return inner.forward(*args)

        program.program = type("Wrapped", (), {"forward": staticmethod(forward)})()


def test_qwen3_gets_a_program_with_its_qk_norms(qwen3: Checkpoint) -> None:
    program = make_cpu_program(qwen3.model, torch.device("cpu"), enabled=True)
    assert isinstance(program, CpuProgram)
    ropes = [op for op in program.ops if isinstance(op, RopeStoreKV)]
    assert len(ropes) == qwen3.arch.num_hidden_layers
    for i, op in enumerate(ropes):
        attn = qwen3.model.model.layers[i].self_attn
        assert op.q_norm is attn.q_norm.weight and op.k_norm is attn.k_norm.weight
        assert (op.cache, op.head_dim) == (i, 32)


def _eager_and_program(model: nn.Module, arch: ArchConfig, dtype: torch.dtype,
                       ref: nn.Module | None = None) -> list[tuple[torch.Tensor, ...]]:
    """(eager, program[, fp32 reference]) hidden states of decode-only and prompt steps."""
    program = CpuProgram(model)
    counted = Counted(program)
    cache = PagedKVCache.for_arch(arch, num_blocks=64, dtype=dtype, seed=3)
    ref_cache = PagedKVCache.for_arch(arch, num_blocks=64, seed=3) if ref is not None else None
    other = cache.clone()
    out = []
    for i, chunks in enumerate(PREFILL_STEPS):
        eager, got = prefill_both(model, program, cache, other, chunks, arch.vocab_size, i)
        want = _reference(ref, ref_cache, chunks, arch, i)
        out.append((eager, got, want))
    for step in range(3):
        tokens = [step, 5, 6, 7]
        eager, got = decode_both(model, program, cache, other, tokens)
        want = _reference(ref, ref_cache, [(s, 1) for s in range(4)], arch, None, tokens)
        out.append((eager, got, want))
    assert counted.calls == len(PREFILL_STEPS) + 3  # every step ran in the C++ program
    return out


def _reference(ref: nn.Module | None, cache: PagedKVCache | None, chunks: list[tuple[int, int]],
               arch: ArchConfig, seed: int | None, tokens: list[int] | None = None
               ) -> torch.Tensor | None:
    if ref is None or cache is None:
        return None
    if tokens is None:
        gen = torch.Generator().manual_seed(seed or 0)
        ids = torch.randint(0, arch.vocab_size, (sum(n for _, n in chunks),), generator=gen)
    else:
        ids = torch.tensor(tokens)
    meta, pos = cache.step(chunks)
    with torch.inference_mode():
        return ref(ids, pos, meta)


def test_qwen3_fp32_steps_match_model_forward(qwen3: Checkpoint) -> None:
    for eager, got, _ in _eager_and_program(qwen3.model, qwen3.arch, torch.float32):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, eager, rtol=0, atol=1e-4)
    program = CpuProgram(qwen3.model)
    hidden = torch.randn(3, qwen3.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(program.logits(hidden), qwen3.model.compute_logits(hidden))


def test_qwen3_bf16_as_close_to_fp32_as_model_forward(qwen3: Checkpoint) -> None:
    ref = copy.deepcopy(qwen3.model).to(torch.bfloat16).float()
    model = copy.deepcopy(qwen3.model).to(torch.bfloat16)
    for eager, got, want in _eager_and_program(model, qwen3.arch, torch.bfloat16, ref):
        assert got.dtype == torch.bfloat16
        err_eager = (eager.float() - want).abs().max().item()
        err_program = (got.float() - want).abs().max().item()
        assert err_program <= 2 * err_eager + 1e-2, (err_program, err_eager)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_qwen3_quantized_as_close_as_model_forward(qwen3: Checkpoint, kind: str) -> None:
    model = quantized_copy(qwen3.model, kind)
    ref = dequantized_copy(model)
    qkv = model.model.layers[0].self_attn.qkv_proj
    atol = 0.15 if kind == "int4" and qkv.activation_bits(decode_only=True) == 8 else 5e-2
    for eager, got, want in _eager_and_program(model, qwen3.arch, torch.float32, ref):
        err_eager = (eager - want).abs().max().item()
        err_program = (got - want).abs().max().item()
        assert err_program <= 2 * err_eager + 1e-2, (err_program, err_eager)
        torch.testing.assert_close(got, eager, rtol=0, atol=atol)


class ToyForCausalLM(DecoderForCausalLM):
    """A family said only here: q/k norms and biases on every attention projection (no
    family in tokenmill has both)."""

    @classmethod
    def attention_options(cls, config: ArchConfig) -> layers.AttentionOptions:
        return layers.AttentionOptions(qkv_bias=True, o_bias=True, qk_norm=True)


TOY = ArchConfig(architecture="ToyForCausalLM", vocab_size=256, hidden_size=96,
                 intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=3, head_dim=16, max_position_embeddings=256,
                 tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000.0)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    monkeypatch.setitem(registry._MODELS, "ToyForCausalLM", (__name__, "ToyForCausalLM"))
    model = registry.create_model(TOY, torch.float32, "cpu")
    assert type(model) is ToyForCausalLM
    randomize(model, seed=7)
    return model.eval()


def test_a_new_family_gets_a_program_with_no_code_of_its_own(toy: nn.Module) -> None:
    program = CpuProgram(toy)
    o_projs = [op for op in program.ops if isinstance(op, Linear) and op.path.endswith("o_proj")]
    assert len(o_projs) == 3 and all(op.parts.bias is not None for op in o_projs)
    assert all(op.head_dim == 16 and op.heads == 6 for op in program.ops
               if isinstance(op, Attention))
    for eager, got, _ in _eager_and_program(toy, TOY, torch.float32):
        torch.testing.assert_close(got, eager, rtol=0, atol=1e-4)


class SquaredReluMLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x)) ** 2


class ScaledNorm(layers.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_unknown_blocks_are_refused_at_load(toy: nn.Module) -> None:
    model = copy.deepcopy(toy)
    model.model.layers[1].mlp = SquaredReluMLP(TOY.hidden_size)
    with pytest.raises(UnsupportedModel, match=r"model\.layers\.1\.mlp.*SquaredReluMLP"):
        CpuProgram(model)
    assert make_cpu_program(model, torch.device("cpu"), enabled=True) is None
    model = copy.deepcopy(toy)
    norm = ScaledNorm(TOY.head_dim, TOY.rms_norm_eps)
    model.model.layers[2].self_attn.k_norm = norm
    with pytest.raises(UnsupportedModel, match=r"k_norm \(ScaledNorm\) overrides RMSNorm"):
        CpuProgram(model)
    # The untouched model still gets its program, and runs as before.
    program = CpuProgram(toy)
    cache = PagedKVCache.for_arch(TOY, num_blocks=32)
    prefill(toy, cache, PROMPT_LENS[:2], TOY.vocab_size)
    other = cache.clone()
    want, got = decode_both(toy, program, cache, other, [1, 2])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_bad_ops_are_refused_by_the_cpp_program() -> None:
    from tokenmill.kernels.cpu import load_extension

    program = load_extension().Program()
    h = program.add_buffer(8, 0)
    x = program.add_buffer(8, 1)
    with pytest.raises(RuntimeError, match="rms_norm"):
        program.add_rms_norm(h, x, torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="dtype class"):
        program.add_add(x, h)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        program.add_attention(h, x, 0, 3, 2, 4, 0.5, 0)
