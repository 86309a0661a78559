"""Qwen3-MoE and Mixtral against Hugging Face transformers in fp32: every position's logits
through the paged cache, and greedy tokens through the engine (chunked prefill, prefix
caching, preemption, n > 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import COMMON, Checkpoint, load_ours, randomize, write_tokenizer
from paged import PagedKVCache, run_step
from test_models_parity import hf_logits, prompts

from tokenmill.models.moe import SparseMoeBlock

# family -> (transformers config class, config kwargs over hf_checkpoints.COMMON)
MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # A dense layer among the sparse ones (mlp_only_layers), top-k renormalised.
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False)),
    # Every second layer sparse, top-k weights as the softmax gave them.
    "qwen3_moe_sparse_step": ("Qwen3MoeConfig", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False,
        mlp_only_layers=[], decoder_sparse_step=2, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False)),
}
PROMPT_LENS = (5, 17, 1, 33, 48)
DECODE_STEPS = 3


def make_moe_checkpoint(family: str, path: Path) -> Checkpoint:
    """A tiny random checkpoint of ``family`` saved at ``path``, HF's model and ours."""
    transformers = pytest.importorskip("transformers")
    config_cls, extra = MOE_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model_cls = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))
    hf_model = model_cls(config)
    randomize(hf_model, seed=sorted(MOE_FAMILIES).index(family))
    hf_model.save_pretrained(path)
    write_tokenizer(path)
    hf_model = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model, arch = load_ours(path)
    return Checkpoint(path, hf_model.eval(), model, arch)


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_moe_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_sparse_layers_as_configured(moe: Checkpoint) -> None:
    arch = moe.arch
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in moe.model.model.layers]
    assert sparse == [arch.is_moe_layer(i) for i in range(arch.num_hidden_layers)]
    assert any(sparse)
    hf_sparse = ["experts" in dict(layer.mlp.named_children())
                 for layer in moe.hf_model.model.layers]
    assert sparse == hf_sparse


def test_logits_match_transformers(moe: Checkpoint) -> None:
    """All prompts prefilled in one step, then decode-only steps: every position's logits."""
    seqs = prompts(moe.arch.vocab_size, PROMPT_LENS)
    cache = PagedKVCache.for_arch(moe.arch, num_blocks=48, block_size=16)
    ours = [[x] for x in run_step(moe.model, cache, list(enumerate(seqs)))]
    gen = torch.Generator().manual_seed(1)
    for _ in range(DECODE_STEPS):
        new = torch.randint(0, moe.arch.vocab_size, (len(seqs),), generator=gen).tolist()
        for seq, tok in zip(seqs, new, strict=True):
            seq.append(tok)
        step = run_step(moe.model, cache, [(i, [t]) for i, t in enumerate(new)])
        for acc, logits in zip(ours, step, strict=True):
            acc.append(logits)
    for i, seq in enumerate(seqs):
        got, want = torch.cat(ours[i]), hf_logits(moe, seq)
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff <= 1e-3, f"sequence {i} (len {len(seq)}): max |diff| {diff}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_bfloat16_as_close_to_float32_as_transformers(moe: Checkpoint) -> None:
    """bf16 against fp32: a token whose router scores two experts nearly alike may pick
    another expert in bf16 (transformers' bf16 does too), so the bound is transformers' own
    bf16 error."""
    import copy

    (ids,) = prompts(moe.arch.vocab_size, (21,), seed=6)
    model16 = copy.deepcopy(moe.model).to(torch.bfloat16)
    (got,) = run_step(model16, PagedKVCache.for_arch(moe.arch, dtype=torch.bfloat16), [(0, ids)])
    want = hf_logits(moe, ids)
    with torch.no_grad():
        hf16 = copy.deepcopy(moe.hf_model).to(torch.bfloat16)(torch.tensor([ids])).logits[0]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    ours, theirs = ((x.float() - want).abs().max().item() for x in (got, hf16))
    assert ours <= 1.5 * theirs + 0.05, (ours, theirs)
