"""Gemma 3 (text) through the paged cache against transformers in fp32: every position's
logits over prompts shorter than, at and far past the sliding window, prefilled whole, in
chunks and decoded; its config read from both config.json layouts; its blocks as built."""

from __future__ import annotations

import copy

import pytest
import torch
from gemma3_checkpoint import WINDOW, make_gemma3_checkpoint
from hf_checkpoints import Checkpoint
from paged import PagedKVCache, run_step
from test_models_parity import hf_logits, prompts

from tokenmill.models.config import ArchConfig
from tokenmill.models.gemma3 import GeluGatedMLP, Gemma3ForCausalLM

# Shorter than the window, exactly at it, past it, and far past it (several windows).
PROMPT_LENS = (5, WINDOW, 19, 70)
DECODE_STEPS = 12  # the shorter prompts decode past the window too


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))


def test_layers_as_configured(gemma: Checkpoint) -> None:
    model = gemma.model
    assert isinstance(model, Gemma3ForCausalLM)
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == [WINDOW, None, WINDOW, WINDOW, None]
    assert all(isinstance(layer.mlp, GeluGatedMLP) for layer in model.model.layers)
    assert model.model.layers[0].self_attn.scale == pytest.approx(24 ** -0.5)
    # (1 + w) folded at load: ours hold HF's weight plus one.
    hf_norm = gemma.hf_model.model.layers[2].pre_feedforward_layernorm.weight
    torch.testing.assert_close(model.model.layers[2].pre_feedforward_layernorm.weight,
                               hf_norm + 1)


def _all_logits(model: torch.nn.Module, arch: ArchConfig, seqs: list[list[int]],
                chunk: int | None) -> list[torch.Tensor]:
    """Every position's logits: the prompts prefilled together (``chunk`` tokens a step, None:
    whole), then DECODE_STEPS decode-only steps of all of them."""
    cache = PagedKVCache.for_arch(arch, num_blocks=64, block_size=4)
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    prompt_lens = [len(s) - DECODE_STEPS for s in seqs]
    while any(d < n for d, n in zip(done, prompt_lens, strict=True)):
        batch = []
        for i, (d, n) in enumerate(zip(done, prompt_lens, strict=True)):
            if d < n:
                end = n if chunk is None else min(n, d + chunk)
                batch.append((i, seqs[i][d:end]))
                done[i] = end
        for (i, _), logits in zip(batch, run_step(model, cache, batch), strict=True):
            out[i].append(logits)
    for step in range(DECODE_STEPS):
        batch = [(i, [s[prompt_lens[i] + step]]) for i, s in enumerate(seqs)]
        for (i, _), logits in zip(batch, run_step(model, cache, batch), strict=True):
            out[i].append(logits)
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("chunk", [None, 6], ids=["whole", "chunked"])
def test_logits_match_transformers(gemma: Checkpoint, chunk: int | None) -> None:
    seqs = prompts(gemma.arch.vocab_size, tuple(n + DECODE_STEPS for n in PROMPT_LENS))
    for i, got in enumerate(_all_logits(gemma.model, gemma.arch, seqs, chunk)):
        want = hf_logits(gemma, seqs[i])
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff <= 1e-3, f"sequence {i} (len {len(seqs[i])}): max |diff| {diff}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_window_matters(gemma: Checkpoint) -> None:
    """The same model with every layer global differs past the window only: so the masks
    above are what makes the parity (a test that could not fail otherwise)."""
    arch = gemma.arch
    full = copy.deepcopy(gemma.model)
    for layer in full.model.layers:
        layer.self_attn.window = None
    (ids,) = prompts(arch.vocab_size, (30,), seed=3)
    (windowed,) = run_step(gemma.model, PagedKVCache.for_arch(arch, block_size=4), [(0, ids)])
    (plain,) = run_step(full, PagedKVCache.for_arch(arch, block_size=4), [(0, ids)])
    torch.testing.assert_close(windowed[:WINDOW], plain[:WINDOW], rtol=0, atol=1e-5)
    assert (windowed[WINDOW:] - plain[WINDOW:]).abs().max().item() > 1e-2


def test_transformers_4_config_layout(gemma: Checkpoint) -> None:
    """rope_theta / rope_local_base_freq / rope_scaling and sliding_window_pattern (the
    layout of the configs on the hub) read as transformers 5's per-layer-type dicts."""
    d = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
         "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
         "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0},
         "max_position_embeddings": 32768}
    arch = ArchConfig.from_hf_dict(d)
    assert arch.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (arch.rope_theta, arch.rope_local_base_freq) == (1000000.0, 10000.0)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert arch.max_position_embeddings == 32768  # not capped at the window
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.query_pre_attn_scalar == 256
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ArchConfig.from_hf_dict({**d, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="layer_types has 2 entries for 7 layers"):
        ArchConfig.from_hf_dict({**d, "layer_types": ["full_attention"] * 2})
    # Another family keeps refusing a GELU MLP, naming what it takes.
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh'.*'silu'"):
        ArchConfig.from_hf_dict({**d, "architectures": ["LlamaForCausalLM"],
                                 "hidden_act": "gelu_pytorch_tanh"})


def test_bfloat16_as_close_to_float32_as_transformers(gemma: Checkpoint) -> None:
    (ids,) = prompts(gemma.arch.vocab_size, (25,), seed=6)
    model16 = copy.deepcopy(gemma.model).to(torch.bfloat16)
    cache = PagedKVCache.for_arch(gemma.arch, dtype=torch.bfloat16)
    (got,) = run_step(model16, cache, [(0, ids)])
    want = hf_logits(gemma, ids)
    with torch.no_grad():
        hf16 = copy.deepcopy(gemma.hf_model).to(torch.bfloat16)
        theirs = hf16(torch.tensor([ids])).logits[0].float()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # (Norm weights near 2 make this random model's bf16 error large: transformers' too.)
    err, err_hf = ((x - want).abs().max().item() for x in (got, theirs))
    assert err <= 1.5 * err_hf + 0.05, (err, err_hf)
