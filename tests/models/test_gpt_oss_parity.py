"""gpt-oss through the paged cache against transformers in fp32: every position's logits over
prompts shorter than, at and far past the sliding window, prefilled whole, in chunks and
decoded; each feature shown to matter (sinks, the SwiGLU's clamp); its blocks as built; its
config in transformers 4's layout (the hub's) and bad expert shapes refused by name."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from gpt_oss_checkpoint import WINDOW, make_gpt_oss_checkpoint
from hf_checkpoints import Checkpoint, load_ours
from paged import PagedKVCache, run_step
from safetensors.torch import load_file, save_file
from test_models_parity import hf_logits, prompts

from tokenmill.models.config import ArchConfig
from tokenmill.models.gpt_oss import GptOssExperts, GptOssForCausalLM, clamped_swiglu

PROMPT_LENS = (5, WINDOW, 19, 40)
DECODE_STEPS = 10  # the shorter prompts decode past the window too


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss"))


def test_layers_as_configured(gpt_oss: Checkpoint) -> None:
    model = gpt_oss.model
    assert isinstance(model, GptOssForCausalLM)
    layers = model.model.layers
    assert [layer.self_attn.window for layer in layers] == [WINDOW, None, WINDOW]
    hf_layer = gpt_oss.hf_model.model.layers[1]
    torch.testing.assert_close(layers[1].self_attn.sinks, hf_layer.self_attn.sinks)
    torch.testing.assert_close(layers[1].mlp.router.bias, hf_layer.mlp.router.bias)
    experts = layers[1].mlp.experts
    assert isinstance(experts, GptOssExperts)
    # The interleaved gate/up columns as gate rows then up rows.
    hf_gate_up = hf_layer.mlp.experts.gate_up_proj[2]  # [H, 2I]
    torch.testing.assert_close(experts.w13[2], torch.cat([hf_gate_up[:, ::2].T,
                                                          hf_gate_up[:, 1::2].T]))
    torch.testing.assert_close(experts.w2[2], hf_layer.mlp.experts.down_proj[2].T)


def _all_logits(model: torch.nn.Module, arch: ArchConfig, seqs: list[list[int]],
                chunk: int | None) -> list[torch.Tensor]:
    """Every position's logits: the prompts prefilled together (``chunk`` tokens a step, None:
    whole), then DECODE_STEPS decode-only steps of all of them."""
    cache = PagedKVCache.for_arch(arch, num_blocks=96, block_size=4)
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
def test_logits_match_transformers(gpt_oss: Checkpoint, chunk: int | None) -> None:
    seqs = prompts(gpt_oss.arch.vocab_size, tuple(n + DECODE_STEPS for n in PROMPT_LENS))
    for i, got in enumerate(_all_logits(gpt_oss.model, gpt_oss.arch, seqs, chunk)):
        want = hf_logits(gpt_oss, seqs[i])
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff <= 1e-3, f"sequence {i} (len {len(seqs[i])}): max |diff| {diff}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def _logits(model: torch.nn.Module, arch: ArchConfig, ids: list[int]) -> torch.Tensor:
    (out,) = run_step(model, PagedKVCache.for_arch(arch, block_size=4), [(0, ids)])
    return out


def test_sinks_window_and_clamp_each_matter(gpt_oss: Checkpoint) -> None:
    """The model without sinks, without windows or without the clamp gives other logits: so
    the parity above depends on each (a test that could not fail otherwise)."""
    arch = gpt_oss.arch
    (ids,) = prompts(arch.vocab_size, (30,), seed=3)
    base = _logits(gpt_oss.model, arch, ids)
    variants = [copy.deepcopy(gpt_oss.model) for _ in range(3)]
    for layer in variants[0].model.layers:
        layer.self_attn.sinks.zero_().sub_(1e4)  # exp(-1e4): no sink at all
    for layer in variants[1].model.layers:
        layer.self_attn.window = None
    for layer in variants[2].model.layers:
        layer.mlp.experts.activation = functools.partial(clamped_swiglu, alpha=1.702,
                                                          limit=1e9)
    for name, model in zip(("sinks", "window", "clamp"), variants, strict=True):
        diff = (_logits(model, arch, ids) - base).abs().max().item()
        assert diff > 1e-2, f"{name} changes nothing ({diff})"


def test_transformers_4_config_layout() -> None:
    """The hub's config.json: rope_theta beside rope_scaling (yarn), no layer_types (sliding
    and full alternating), num_local_experts, an MXFP4 quantization_config."""
    d = {"architectures": ["GptOssForCausalLM"], "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 6,
         "num_experts_per_tok": 2, "experts_per_token": 2, "rope_theta": 150000,
         "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                          "original_max_position_embeddings": 4096, "rope_type": "yarn",
                          "truncate": False},
         "sliding_window": 128, "swiglu_limit": 7.0, "max_position_embeddings": 131072,
         "attention_bias": True, "hidden_act": "silu",
         "quantization_config": {"quant_method": "mxfp4"}}
    arch = ArchConfig.from_hf_dict(d)
    assert arch.layer_types == ("sliding_attention", "full_attention") * 2
    assert (arch.sliding_window, arch.max_position_embeddings) == (128, 131072)
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "yarn"
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (6, 2, 32)
    assert (arch.swiglu_limit, arch.swiglu_alpha) == (7.0, 1.702)
    with pytest.raises(ValueError, match="rope_scaling.factor must be a number >= 1"):
        ArchConfig.from_hf_dict({**d, "rope_scaling": {**d["rope_scaling"], "factor": 0.5}})


def test_expert_count_and_width_refused_by_name(gpt_oss: Checkpoint, tmp_path) -> None:
    (tmp_path / "config.json").write_text((gpt_oss.path / "config.json").read_text())
    weights = load_file(gpt_oss.path / "model.safetensors")
    for key, edit, match in [
        ("model.layers.1.mlp.experts.gate_up_proj", lambda t: t[:5], "num_local_experts is 6"),
        ("model.layers.0.mlp.experts.down_proj", lambda t: t[:, :16], "intermediate_size is 32"),
    ]:
        save_file({**weights, key: edit(weights[key]).contiguous()},
                  tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match=match):
            load_ours(tmp_path)
    config = json.loads((gpt_oss.path / "config.json").read_text())
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    with pytest.raises(ValueError, match="num_local_experts is 8"):
        load_ours(tmp_path)


def test_a_fused_moe_kernel_set_is_declined_at_load_with_a_log_line(
        gpt_oss: Checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    """Bound to a kernel set whose MoE is a fused SiLU kernel (CUDA's), the experts keep the
    grouped PyTorch path with the clamped SwiGLU, and the model says so once, at load."""
    import dataclasses
    import logging

    from tokenmill.kernels.moe import torch_moe
    from tokenmill.models.kernel_binding import TORCH_KERNELS, bind_kernels

    def fused_silu_only(*args: object) -> torch.Tensor:
        raise AssertionError("the SiLU-gated kernel ran gpt-oss's experts")

    model = copy.deepcopy(gpt_oss.model)
    with caplog.at_level(logging.INFO, logger="tokenmill.models.gpt_oss"):
        bind_kernels(model, kernels=dataclasses.replace(TORCH_KERNELS, name="fused",
                                                        moe=fused_silu_only))
    assert caplog.text.count("clamped-SwiGLU experts run on the grouped PyTorch path") == 1
    assert all(layer.mlp.experts._moe is torch_moe for layer in model.model.layers)
    (ids,) = prompts(gpt_oss.arch.vocab_size, (12,), seed=4)
    torch.testing.assert_close(_logits(model, gpt_oss.arch, ids),
                               _logits(gpt_oss.model, gpt_oss.arch, ids), rtol=0, atol=0)


def test_bfloat16_as_close_to_float32_as_transformers(gpt_oss: Checkpoint) -> None:
    (ids,) = prompts(gpt_oss.arch.vocab_size, (25,), seed=6)
    model16 = copy.deepcopy(gpt_oss.model).to(torch.bfloat16)
    cache = PagedKVCache.for_arch(gpt_oss.arch, dtype=torch.bfloat16, block_size=4)
    (got,) = run_step(model16, cache, [(0, ids)])
    want = hf_logits(gpt_oss, ids)
    with torch.no_grad():
        hf16 = copy.deepcopy(gpt_oss.hf_model).to(torch.bfloat16)
        theirs = hf16(torch.tensor([ids])).logits[0].float()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    err, err_hf = ((x - want).abs().max().item() for x in (got, theirs))
    assert err <= 1.5 * err_hf + 0.05, (err, err_hf)
