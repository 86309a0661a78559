"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers in fp32 on small random checkpoints:
fused qkv and gate_up, partial rotary (Phi-4-mini), longrope's short and long factors; through
the paged cache, the CPU op program and the engine (chunked prefill, prefix caching, n > 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import Checkpoint, load_ours, randomize, write_tokenizer
from paged import PagedKVCache, run_step

from tokenmill import LLM, SamplingParams
from tokenmill.runner.cpu_lowering import RopeStoreKV
from tokenmill.runner.cpu_program import CpuProgram

transformers = pytest.importorskip("transformers")

SHORT = [1.0 + 0.25 * i for i in range(6)]  # 6 = half the rotated dims of 16 * 0.75
LONG = [2.0 + 0.75 * i for i in range(6)]
SHORT_FULL = [1.0 + 0.2 * i for i in range(8)]
LONG_FULL = [1.5 + 0.6 * i for i in range(8)]
ORIGINAL = 32  # the "pretraining" context of the long variants: prompts go past it

# variant -> Phi3Config kwargs beside the common ones
VARIANTS: dict[str, dict[str, Any]] = {
    # Phi-3-mini-4k: as many KV heads as heads, full rotary, no rope scaling, untied head.
    "phi3_mini": dict(num_key_value_heads=4, max_position_embeddings=256),
    # Phi-4-mini within its pretraining context: GQA, partial rotary, tied, short factors.
    "phi4_mini_short": dict(
        num_key_value_heads=2, partial_rotary_factor=0.75, tie_word_embeddings=True,
        max_position_embeddings=256, original_max_position_embeddings=256,
        rope_scaling=dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG)),
    # Phi-3-mini-128k: long factors and the attention factor past the pretraining context.
    "phi3_long": dict(
        num_key_value_heads=4, max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling=dict(rope_type="longrope", short_factor=SHORT_FULL, long_factor=LONG_FULL)),
    # Phi-4-mini (128k): partial rotary with the long factors.
    "phi4_mini_long": dict(
        num_key_value_heads=2, partial_rotary_factor=0.75, tie_word_embeddings=True,
        max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
        rope_scaling=dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG)),
}
# Transformers picks the long factors once a forward's sequence passes the pretraining
# context: the long variants' prompts all do (see rope_scaling.longrope_inv_freq).
PROMPT_LENS = {"phi3_mini": (5, 17, 1, 33), "phi4_mini_short": (5, 17, 1, 33),
               "phi3_long": (33, 47, 64), "phi4_mini_long": (33, 47, 64)}


def make_phi3(variant: str, path: Path) -> Checkpoint:
    """A saved random Phi3ForCausalLM folder (with a tokenizer), HF's model and ours."""
    config = transformers.Phi3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **VARIANTS[variant])
    torch.manual_seed(0)
    hf_model = transformers.Phi3ForCausalLM(config)
    randomize(hf_model, seed=sorted(VARIANTS).index(variant) + 11)
    hf_model.save_pretrained(path)
    write_tokenizer(path)
    hf_model = transformers.Phi3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    model, arch = load_ours(path)
    return Checkpoint(path, hf_model, model, arch)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def phi3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_phi3(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def phi4_long(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_phi3("phi4_mini_long", tmp_path_factory.mktemp("phi4_engine"))


def prompts(lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lens]


def variant_of(ckpt: Checkpoint) -> str:
    return ckpt.path.name.rstrip("0123456789")


def test_config_reads_the_phi3_fields(phi3: Checkpoint) -> None:
    arch, variant = phi3.arch, variant_of(phi3)
    assert arch.architecture == "Phi3ForCausalLM"
    assert arch.rotary_dim == (12 if "phi4" in variant else 16)
    if variant == "phi3_mini":
        assert arch.rope_scaling is None
    else:
        assert arch.rope_scaling["rope_type"] == "longrope"
        assert arch.rope_scaling["original_max_position_embeddings"] == (
            256 if variant == "phi4_mini_short" else ORIGINAL)


@torch.no_grad()
def test_logits_match_transformers(phi3: Checkpoint) -> None:
    """Prompts prefilled in one step, then three decode steps: every position's logits."""
    seqs = prompts(PROMPT_LENS[variant_of(phi3)])
    cache = PagedKVCache.for_arch(phi3.arch, num_blocks=48, block_size=16)
    ours = [[x] for x in run_step(phi3.model, cache, list(enumerate(seqs)))]
    for step in range(3):
        new = [(7 * step + 11 * i) % 250 + 3 for i in range(len(seqs))]
        for seq, tok in zip(seqs, new, strict=True):
            seq.append(tok)
        step_logits = run_step(phi3.model, cache, [(i, [t]) for i, t in enumerate(new)])
        for acc, logits in zip(ours, step_logits, strict=True):
            acc.append(logits)
    for i, seq in enumerate(seqs):
        want = phi3.hf_model(torch.tensor([seq])).logits[0]
        diff = (torch.cat(ours[i]) - want).abs().max().item()
        assert diff <= 1e-4, f"sequence {i} (len {len(seq)}): max |diff| {diff}"


@torch.no_grad()
def test_cpu_program_equals_model_forward(phi3: Checkpoint) -> None:
    """The CPU op program runs Phi-3 from the shared blocks, partial rotary included."""
    program = CpuProgram(phi3.model)
    assert sum(isinstance(op, RopeStoreKV) for op in program.ops) == 2
    seqs = prompts(PROMPT_LENS[variant_of(phi3)], seed=1)
    eager_cache = PagedKVCache.for_arch(phi3.arch, num_blocks=48, seed=2)
    program_cache = eager_cache.clone()
    for chunk in (seqs, [[5 + i] for i in range(len(seqs))]):
        batch = [(i, ids) for i, ids in enumerate(chunk)]
        ids = torch.tensor([t for ids in chunk for t in ids])
        meta_e, pos_e = eager_cache.step([(i, len(c)) for i, c in batch])
        meta_p, pos_p = program_cache.step([(i, len(c)) for i, c in batch])
        assert program.supports(ids, meta_p)
        with torch.inference_mode():
            want = phi3.model(ids, pos_e, meta_e)
            got = program.forward(ids, pos_p, meta_p)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _hf_greedy(ckpt: Checkpoint, ids: list[int], n: int) -> list[int]:
    out = ckpt.hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


# How the engine runs the prompts: whole, in chunks of 16 tokens, or preempted (7 blocks of
# 16 tokens do not hold the first two sequences once they grow).
ENGINE_MODES = {"whole": dict(max_num_batched_tokens=256, enable_chunked_prefill=False,
                              num_kv_blocks=64),
                "chunked_prefill": dict(max_num_batched_tokens=16, num_kv_blocks=64),
                "preempted": dict(max_num_batched_tokens=64, num_kv_blocks=7)}


NEW = 16  # tokens generated per request


@pytest.mark.parametrize("mode", sorted(ENGINE_MODES))
def test_engine_greedy_equals_transformers(phi4_long: Checkpoint, mode: str) -> None:
    """Through the engine and its CPU program: prefix caching on (a shared prefix hits the
    second time), two greedy samples of one prompt (n=2)."""
    llm = LLM(model=str(phi4_long.path), dtype="float32", max_model_len=256,
              quantization="none", seed=0, **ENGINE_MODES[mode])
    try:
        assert llm.engine.core.executor.runner.cpu_program is not None
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        seqs = prompts((40, 57, 36), seed=3)
        shared = seqs[0][:32] + seqs[2][32:]  # the first prompt's two full blocks, then its own
        first = llm.generate(seqs, params)
        hits = llm.engine.core.scheduler.kv.prefix_stats.hits
        second = llm.generate([shared], SamplingParams(temperature=0.0, max_tokens=NEW,
                                                       ignore_eos=True, n=2))[0]
        for ids, out in zip(seqs, first, strict=True):
            assert out.outputs[0].token_ids == _hf_greedy(phi4_long, ids, NEW)
        want = _hf_greedy(phi4_long, shared, NEW)
        assert [c.token_ids for c in second.outputs] == [want, want]
        scheduler = llm.engine.core.scheduler
        if mode == "preempted":
            assert scheduler.num_preemptions_total > 0
        else:
            assert scheduler.kv.prefix_stats.hits - hits >= 32
    finally:
        llm.close()


@pytest.fixture(scope="module")
def phi3_long(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_phi3("phi3_long", tmp_path_factory.mktemp("phi3_long_engine"))


def test_a_context_within_the_pretraining_one_takes_the_short_factors(
        phi3_long: Checkpoint) -> None:
    """--max-model-len at most the pretraining context: the short factors, as transformers
    takes them for every sequence that short (the model's own 256 would take the long)."""
    ids = prompts((20,), seed=9)[0]
    llm = LLM(model=str(phi3_long.path), dtype="float32", max_model_len=ORIGINAL,
              quantization="none", num_kv_blocks=8)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=ORIGINAL - 20, ignore_eos=True)
        got = llm.generate([ids], params)[0].outputs[0].token_ids
    finally:
        llm.close()
    assert got == _hf_greedy(phi3_long, ids, ORIGINAL - 20)
