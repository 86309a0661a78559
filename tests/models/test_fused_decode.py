"""The C++ layer stack against model.forward: hidden states, KV cache writes, greedy output, for
decode-only steps and steps with prompt chunks."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_checkpoints import Checkpoint
from paged import PagedKVCache

from tokenmill.runner.cpu_linear import KIND_FLOAT, UnsupportedModel, linear_parts
from tokenmill.runner.cpu_program import (
    ENV_FLAG,
    PREFILL_ENV_FLAG,
    CpuProgram,
    fused_decode_enabled,
    fused_prefill_enabled,
)
from tokenmill.runner.step_backend import EagerBackend, ModelStep

# Context lengths within, across and exactly at block boundaries (block size 16), and a long one
# so that batch 5 has very different lengths in one step.
PROMPT_LENS = (5, 17, 1, 33, 80)
DECODE_STEPS = 3


def prefill(model: torch.nn.Module, cache: PagedKVCache, lens: tuple[int, ...],
            vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = [(i, torch.randint(0, vocab, (n,), generator=gen).tolist())
             for i, n in enumerate(lens)]
    meta, positions = cache.step([(i, len(ids)) for i, ids in batch])
    ids = torch.tensor([t for _, ids in batch for t in ids])
    with torch.no_grad():
        model(ids, positions, meta)


def decode_both(model: torch.nn.Module, fused: CpuProgram, eager_cache: PagedKVCache,
                fused_cache: PagedKVCache, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of sequences 0..len(tokens)-1 through the eager step backend (which
    marks the int4 layers for a decode-only step, as the runner runs it) and the fused stack."""
    chunks = [(i, 1) for i in range(len(tokens))]
    ids = torch.tensor(tokens)
    meta_e, pos_e = eager_cache.step(chunks)
    meta_f, pos_f = fused_cache.step(chunks)
    assert fused.supports(ids, meta_f)
    with torch.inference_mode():
        eager = EagerBackend(model).forward(ModelStep(ids, pos_e, meta_e))
        return eager, fused.forward(ids, pos_f, meta_f)


@pytest.mark.parametrize("batch", [1, 5])
def test_fp32_matches_model_forward(checkpoint: Checkpoint, batch: int) -> None:
    model, arch = checkpoint.model, checkpoint.arch
    fused = CpuProgram(model)
    cache = PagedKVCache.for_arch(arch, num_blocks=48, block_size=16)
    prefill(model, cache, PROMPT_LENS[:batch] if batch > 1 else (PROMPT_LENS[3],),
            arch.vocab_size)
    other = cache.clone()
    gen = torch.Generator().manual_seed(1)
    for _ in range(DECODE_STEPS):
        tokens = torch.randint(0, arch.vocab_size, (batch,), generator=gen).tolist()
        want, got = decode_both(model, fused, cache, other, tokens)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # Every slot of every layer: the new keys and values landed where model.forward put them,
    # and nothing else was touched.
    for c_e, c_f in zip(cache.kv_caches, other.kv_caches, strict=True):
        torch.testing.assert_close(c_f, c_e, rtol=0, atol=1e-4)


def test_long_contexts_threaded_attention(llama: Checkpoint) -> None:
    """16 sequences of ~250 tokens: enough work per step that the attention loop uses threads."""
    model, arch = llama.model, llama.arch
    fused = CpuProgram(model)
    cache = PagedKVCache.for_arch(arch, num_blocks=16 * 16 + 8)
    prefill(model, cache, tuple(240 + i for i in range(16)), arch.vocab_size)
    other = cache.clone()
    want, got = decode_both(model, fused, cache, other, list(range(16)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_bf16_as_close_to_fp32_as_model_forward(checkpoint: Checkpoint) -> None:
    """bf16 rounding differs in the attention (fp32 inside the C++ loop): compare both paths'
    distance to an fp32 run of the same bf16-rounded weights."""
    ref = copy.deepcopy(checkpoint.model).to(torch.bfloat16).float()
    model = copy.deepcopy(checkpoint.model).to(torch.bfloat16)
    fused = CpuProgram(model)
    arch = checkpoint.arch
    caches = [PagedKVCache.for_arch(arch, num_blocks=48, dtype=dt, seed=3)
              for dt in (torch.float32, torch.bfloat16)]
    prefill(ref, caches[0], PROMPT_LENS, arch.vocab_size)
    prefill(model, caches[1], PROMPT_LENS, arch.vocab_size)
    fused_cache = caches[1].clone()
    tokens = [7, 8, 9, 10, 11]
    meta, pos = caches[0].step([(i, 1) for i in range(5)])
    with torch.inference_mode():
        want = ref(torch.tensor(tokens), pos, meta)
    eager, got = decode_both(model, fused, caches[1], fused_cache, tokens)
    assert got.dtype == torch.bfloat16
    err_eager = (eager.float() - want).abs().max().item()
    err_fused = (got.float() - want).abs().max().item()
    assert err_fused <= 2 * err_eager + 1e-2, (err_fused, err_eager)


def test_refuses_unknown_linear_modules() -> None:
    class Odd(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    with pytest.raises(UnsupportedModel):
        linear_parts(Odd(4, 4), torch.float32)
    with pytest.raises(UnsupportedModel):
        linear_parts(torch.nn.Linear(4, 4).to(torch.bfloat16), torch.float32)


def test_supports_prefill_steps_unless_told_not_to(llama: Checkpoint) -> None:
    cache = PagedKVCache.for_arch(llama.arch, num_blocks=16)
    meta, _ = cache.step([(0, 3), (1, 1)])
    assert CpuProgram(llama.model).supports(torch.zeros(4, dtype=torch.long), meta)
    decode_only = CpuProgram(llama.model, prefill=False)
    assert not decode_only.supports(torch.zeros(4, dtype=torch.long), meta)
    assert not decode_only.supports(torch.zeros(3, dtype=torch.long), meta)  # wrong row count
    meta, _ = cache.step([(0, 1), (1, 1)])
    assert decode_only.supports(torch.zeros(2, dtype=torch.long), meta)


def test_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FLAG, "0")
    assert not fused_decode_enabled()
    assert fused_decode_enabled(True)
    monkeypatch.setenv(ENV_FLAG, "1")
    assert fused_decode_enabled()
    monkeypatch.setenv(ENV_FLAG, "maybe")
    with pytest.raises(ValueError, match=ENV_FLAG):
        fused_decode_enabled()
    monkeypatch.setenv(PREFILL_ENV_FLAG, "0")
    assert not fused_prefill_enabled()
    monkeypatch.delenv(PREFILL_ENV_FLAG)
    assert fused_prefill_enabled()


GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:",
                  "Once upon a time, in a small village by the sea,", "1, 2, 3,"]


def test_engine_greedy_identical_on_and_off(llm) -> None:  # noqa: ANN001 (session fixture)
    """The embedded SmolLM2 through the whole engine: 64 greedy tokens, fused on and off."""
    from tokenmill import SamplingParams

    runner = llm.engine.core.executor.runner
    saved = runner.cpu_program
    fused = CpuProgram(runner.model)
    calls = 0
    stack_forward = fused.forward

    def counted(*args: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return stack_forward(*args)  # type: ignore[arg-type]

    fused.forward = counted  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    try:
        runner.cpu_program = None
        off = [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, params)]
        runner.cpu_program = fused
        on = [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, params)]
    finally:
        runner.cpu_program = saved
    assert calls >= 63  # the decode steps really went through the C++ stack
    assert on == off


@pytest.fixture(scope="module")
def quantized_llm():  # noqa: ANN201
    """The embedded model as `tokenmill serve` loads it: int4 layers, a Q8_0 (int8) table
    tied to the head."""
    from tokenmill import LLM

    return LLM(max_model_len=1024, kv_cache_memory_bytes=64 << 20)


def test_embedded_model_embeds_and_scores_through_the_kernels(quantized_llm) -> None:  # noqa: ANN001
    """The fused decoder looks the tokens up and computes the logits straight from the C++
    kernels, with the bits of the model's own modules, and the engine's greedy tokens are
    those of the modules' paths."""
    from tokenmill import SamplingParams

    runner = quantized_llm.engine.core.executor.runner
    model, fused = runner.model, runner.cpu_program
    table = model.model.embed_tokens
    assert fused is not None and fused._embed is not table and fused._head is not None
    # The head's output tiles were packed with the model, not by the first batched step.
    head = table.matrix
    if head.row_tiles and head.int_activations():
        assert head._tiles is not None
    ids = torch.tensor([1, 42, 49151, 9])
    assert torch.equal(fused._embed(ids), table(ids))
    for rows in (1, 5):
        hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator()
                             .manual_seed(rows))
        assert torch.equal(fused.logits(hidden), model.compute_logits(hidden))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    direct = [o.outputs[0].token_ids for o in quantized_llm.generate(GREEDY_PROMPTS, params)]
    saved = fused._embed, fused._head
    try:
        fused._embed, fused._head = table, None
        modules = [o.outputs[0].token_ids
                   for o in quantized_llm.generate(GREEDY_PROMPTS, params)]
    finally:
        fused._embed, fused._head = saved
    assert direct == modules


def test_runner_does_not_hide_a_failing_stack(llm) -> None:  # noqa: ANN001
    """An error of the CPU program's reaches the step's caller: the runner used to catch it,
    switch to model.forward for good and say so only in a warning; now which steps run
    eagerly is decided by the step backend's supports(), and the next request, on the
    engine's own backend again, gets the tokens it got before."""
    from types import SimpleNamespace

    from tokenmill import SamplingParams
    from tokenmill.runner.flat_batch import FlatBatch

    class Broken:
        lora = False
        prefill = True

        def supports(self, *args: object) -> bool:
            return True

        def forward(self, *args: object) -> torch.Tensor:
            raise RuntimeError("boom")

    runner = llm.engine.core.executor.runner
    saved = runner.cpu_program
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate(GREEDY_PROMPTS[:2], params)
    batch = FlatBatch(runner.block_size)
    batch.add([5, 6, 7], 0, [runner.kv_caches[0].shape[1] - 1])
    ids, positions, meta = batch.build(runner.backend, runner.kv_caches, runner.device)
    try:
        runner.cpu_program = Broken()
        with pytest.raises(RuntimeError, match="boom"), torch.inference_mode():
            runner._forward(SimpleNamespace(input_ids=ids, positions=positions, attn_meta=meta))
    finally:
        runner.cpu_program = saved
    got = llm.generate(GREEDY_PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def quantized_copy(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """``model`` with every projection the int8 / int4 kernels can take replaced by one."""
    from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    model = copy.deepcopy(model)
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            lin = getattr(parent, name)
            try:
                q = (Int8WeightOnlyLinear.from_weight(lin.weight, lin.bias) if kind == "int8"
                     else Int4WeightOnlyLinear.from_weight(lin.weight, lin.bias, group_size=32))
            except ValueError:  # a shape the int4 kernel cannot take: stays float
                continue
            setattr(parent, name, q)
    return model


def dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """fp32 model computing with the weights the quantized modules of ``model`` stand for."""
    ref = copy.deepcopy(model)
    for layer in ref.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if hasattr(child, "dequantize"):
                    lin = torch.nn.Linear(child.in_features, child.out_features,
                                          bias=child.bias is not None)
                    lin.weight.data = child.dequantize()
                    if child.bias is not None:
                        lin.bias.data = child.bias.float()
                    setattr(parent, name, lin)
    return ref


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_as_close_as_model_forward(checkpoint: Checkpoint, kind: str) -> None:
    """Same kernels on both sides, but a last-bit difference in the fp32 glue can flip the bf16
    rounding of a kernel input: so, as for bf16, compare both paths' distance to an fp32 model
    with the dequantized weights, and the two paths to each other loosely. More loosely for
    int4 decoding on int8 activations (INT4_DECODE_ACT_BITS): there such a difference moves an
    input across a step of 1/127 of its block's largest value, not 1/32767."""
    pytest.importorskip("tokenmill.quant.linear")
    model = quantized_copy(checkpoint.model, kind)
    ref = dequantized_copy(model)
    fused = CpuProgram(model)
    qkv = model.model.layers[0].self_attn.qkv_proj
    int8_acts = kind == "int4" and qkv.activation_bits(decode_only=True) == 8
    atol = 0.15 if int8_acts else 5e-2
    assert linear_parts(qkv, torch.float32).kind != KIND_FLOAT  # taken as quantized
    arch = checkpoint.arch
    cache = PagedKVCache.for_arch(arch, num_blocks=48)
    prefill(ref, cache, PROMPT_LENS, arch.vocab_size)
    caches = [cache.clone(), cache.clone()]
    for step in range(DECODE_STEPS):
        tokens = [step, 5, 6, 7, 8]
        meta, pos = cache.step([(i, 1) for i in range(5)])
        with torch.inference_mode():
            want = ref(torch.tensor(tokens), pos, meta)
        eager, got = decode_both(model, fused, caches[0], caches[1], tokens)
        err_eager = (eager - want).abs().max().item()
        err_fused = (got - want).abs().max().item()
        assert err_fused <= 2 * err_eager + 1e-2, (err_fused, err_eager)
        torch.testing.assert_close(got, eager, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_large_batches_take_the_dense_path(llama: Checkpoint, kind: str) -> None:
    """From dense_min_rows rows on, tokenmill.quant dequantizes for one dense matmul: the stack
    takes the same route, so a batch at the threshold computes as model.forward does."""
    pytest.importorskip("tokenmill.quant.linear")
    model = quantized_copy(llama.model, kind)
    n = 12
    for layer in model.model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            if hasattr(mod, "dense_min_rows"):
                mod.dense_min_rows = n
    fused = CpuProgram(model)
    cache = PagedKVCache.for_arch(llama.arch, num_blocks=2 * n + 8)
    prefill(model, cache, tuple(3 + i for i in range(n)), llama.arch.vocab_size)
    other = cache.clone()
    want, got = decode_both(model, fused, cache, other, list(range(n)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


def prefill_both(model: torch.nn.Module, fused: CpuProgram, eager_cache: PagedKVCache,
                 fused_cache: PagedKVCache, chunks: list[tuple[int, int]], vocab: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ``chunks`` (sequence, new tokens) through model.forward and the stack."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(n for _, n in chunks),), generator=gen)
    meta_e, pos_e = eager_cache.step(chunks)
    meta_f, pos_f = fused_cache.step(chunks)
    assert fused.supports(ids, meta_f)
    with torch.inference_mode():
        return model(ids, pos_e, meta_e), fused.forward(ids, pos_f, meta_f)


# Fresh prompts, a decode beside a prompt, chunks continuing a context across key blocks.
PREFILL_STEPS = [[(0, 70), (1, 5), (2, 1)], [(0, 1), (1, 40), (2, 1), (3, 17)],
                 [(3, 66), (0, 2)]]


def test_prefill_steps_match_model_forward(checkpoint: Checkpoint) -> None:
    model, arch = checkpoint.model, checkpoint.arch
    fused = CpuProgram(model)
    assert fused.prefill
    cache = PagedKVCache.for_arch(arch, num_blocks=64, block_size=16)
    other = cache.clone()
    for i, chunks in enumerate(PREFILL_STEPS):
        want, got = prefill_both(model, fused, cache, other, chunks, arch.vocab_size, i)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    for c_e, c_f in zip(cache.kv_caches, other.kv_caches, strict=True):
        torch.testing.assert_close(c_f, c_e, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_prefill_steps_as_close_as_model_forward(llama: Checkpoint, kind: str) -> None:
    """Prompt steps cross the own-kernel and dense row thresholds (set low here) in one run."""
    pytest.importorskip("tokenmill.quant.linear")
    model = quantized_copy(llama.model, kind)
    for layer in model.model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            if hasattr(mod, "dense_min_rows"):
                mod.dense_min_rows = 48
    ref = dequantized_copy(model)
    fused = CpuProgram(model)
    arch = llama.arch
    caches = [PagedKVCache.for_arch(arch, num_blocks=64) for _ in range(3)]
    for i, chunks in enumerate(PREFILL_STEPS):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, arch.vocab_size, (sum(n for _, n in chunks),), generator=gen)
        meta, pos = caches[2].step(chunks)
        with torch.inference_mode():
            want = ref(ids, pos, meta)
        eager, got = prefill_both(model, fused, caches[0], caches[1], chunks, arch.vocab_size, i)
        err_eager = (eager - want).abs().max().item()
        err_fused = (got - want).abs().max().item()
        assert err_fused <= 2 * err_eager + 1e-2, (chunks, err_fused, err_eager)
        torch.testing.assert_close(got, eager, rtol=0, atol=5e-2)


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_any_block_size(checkpoint: Checkpoint, block_size: int) -> None:
    """The attention walks each sequence's blocks (shuffled, the last one partly filled) for
    block sizes that do not divide the lengths, one token a block, and more than a prompt."""
    model, arch = checkpoint.model, checkpoint.arch
    fused = CpuProgram(model)
    cache = PagedKVCache.for_arch(arch, num_blocks=48 * 16 // block_size + 8,
                                  block_size=block_size)
    prefill(model, cache, PROMPT_LENS[:3], arch.vocab_size)
    other = cache.clone()
    want, got = decode_both(model, fused, cache, other, [3, 1, 4])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_int4_activation_bits_follow_the_step_kind(llama: Checkpoint) -> None:
    """The stack's int4 layers take their decode bits (decode_act_bits) in decode-only steps
    and the prompt bits in steps with prompt tokens: two stacks that differ in the decode bits
    only give the same prompt steps and different decode steps."""
    from tokenmill.quant.linear import Int4WeightOnlyLinear

    model = quantized_copy(llama.model, "int4")
    layers = [m for m in model.modules() if isinstance(m, Int4WeightOnlyLinear)]
    if not layers or not layers[0].int_activations():
        pytest.skip("the int4 layers run no integer activations here")
    stacks = {}
    for bits in (8, 16):
        for m in layers:
            m.decode_act_bits = bits
        stacks[bits] = CpuProgram(model)
    arch = llama.arch
    cache = PagedKVCache.for_arch(arch, num_blocks=48)
    caches = {bits: cache.clone() for bits in stacks}
    chunks = [(0, 9), (1, 4)]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, arch.vocab_size, (13,), generator=gen)
    outs = {}
    for bits, stack in stacks.items():
        meta, pos = caches[bits].step(chunks)
        with torch.inference_mode():
            outs[bits] = stack.forward(ids, pos, meta)
    assert torch.equal(outs[8], outs[16])  # prompt steps: INT4_ACT_BITS either way
    decode_ids = torch.tensor([5, 6])
    outs = {}
    for bits, stack in stacks.items():
        meta, pos = caches[bits].step([(0, 1), (1, 1)])
        with torch.inference_mode():
            outs[bits] = stack.forward(decode_ids, pos, meta)
    assert not torch.equal(outs[8], outs[16])  # decode steps: each stack's own bits
