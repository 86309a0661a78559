"""Config parsing, the registry, safetensors folders, load_weights errors and dummy weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import Checkpoint, load_ours
from paged import PagedKVCache, run_step

from tokenmill.model_loader.dummy import build_dummy_model, init_dummy_weights
from tokenmill.model_loader.hf import iter_safetensors, load_hf_config
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class, supported_architectures

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
    "bos_token_id": 1, "eos_token_id": [2, 3], "torch_dtype": "bfloat16",
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_arch_config_transformers4_layout() -> None:
    d = {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}
    arch = ArchConfig.from_hf_dict(d)
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.head_dim, arch.num_key_value_heads) == (32, 2)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == {"rope_type": "llama3", **LLAMA3}
    assert arch.eos_token_ids == (2, 3) and arch.bos_token_id == 1
    assert arch.torch_dtype == "bfloat16" and not arch.tie_word_embeddings


def test_arch_config_transformers5_layout() -> None:
    d = {**BASE, "dtype": "float16",
         "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", **LLAMA3}}
    del d["torch_dtype"], d["num_key_value_heads"]
    arch = ArchConfig.from_hf_dict(d)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == {"rope_type": "llama3", **LLAMA3}
    assert arch.num_key_value_heads == 8 and arch.torch_dtype == "float16"
    plain = ArchConfig.from_hf_dict(
        {**BASE, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_arch_config_old_type_key_and_sliding_window_cap() -> None:
    arch = ArchConfig.from_hf_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0},
                                    "sliding_window": 1024})
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert arch.max_position_embeddings == 1024  # sliding window is not implemented: cap
    off = ArchConfig.from_hf_dict({**BASE, "sliding_window": 1024, "use_sliding_window": False})
    assert off.max_position_embeddings == 4096


@pytest.mark.parametrize("change,field", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"architectures": []}, "architectures"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_arch_config_validation_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ArchConfig.from_hf_dict({**BASE, **change})


def test_registry() -> None:
    assert get_model_class(["MistralForCausalLM"]) is get_model_class(["LlamaForCausalLM"])
    assert get_model_class(["Nope", "Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])
    assert "Qwen2ForCausalLM" in supported_architectures()


def test_sharded_checkpoint_loads_the_same(llama: Checkpoint, tmp_path: Path) -> None:
    llama.hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    sharded = dict(iter_safetensors(tmp_path))
    single = dict(iter_safetensors(llama.path))
    assert sharded.keys() == single.keys()
    model, _ = load_ours(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), llama.model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def test_hf_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert load_hf_config(tmp_path)["vocab_size"] == 1000
    with pytest.raises(ValueError, match="safetensors"):
        list(iter_safetensors(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="model-00001-of-00002"):
        list(iter_safetensors(tmp_path))


def _fresh(ckpt: Checkpoint) -> torch.nn.Module:
    return get_model_class([ckpt.arch.architecture])(ckpt.arch)


def test_missing_tensor_is_named(llama: Checkpoint) -> None:
    weights = [(n, t) for n, t in iter_safetensors(llama.path)
               if n != "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        _fresh(llama).load_weights(weights)


def test_unexpected_tensor_is_named(llama: Checkpoint) -> None:
    weights = [*iter_safetensors(llama.path), ("model.layers.0.self_attn.extra.weight",
                                                torch.zeros(2))]
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.self_attn\.extra"):
        _fresh(llama).load_weights(weights)


def test_wrong_shape_is_named(llama: Checkpoint) -> None:
    weights = [(n, t[:-1] if n == "model.layers.0.self_attn.k_proj.weight" else t)
               for n, t in iter_safetensors(llama.path)]
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(31, 64\).*\(32, 64\)"):
        _fresh(llama).load_weights(weights)


def test_tied_model_ignores_lm_head_and_rotary_buffers(llama: Checkpoint) -> None:
    tied = dataclasses.replace(llama.arch, tie_word_embeddings=True)
    weights = [*iter_safetensors(llama.path),  # has an lm_head.weight, accepted and ignored
               ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))]
    model = get_model_class([tied.architecture])(tied)
    model.load_weights(weights)
    assert model.lm_head is None
    hidden = torch.randn(2, tied.hidden_size)
    embed = dict(iter_safetensors(llama.path))["model.embed_tokens.weight"]
    assert torch.allclose(model.compute_logits(hidden), hidden @ embed.T)


def test_dummy_weights_and_forward() -> None:
    arch = ArchConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    model = build_dummy_model(arch, torch.float32, "cpu", seed=3)
    params = dict(model.named_parameters())
    assert torch.all(params["model.norm.weight"] == 1)
    assert torch.all(params["model.layers.0.self_attn.qkv_proj.bias"] == 0)
    std = params["model.layers.0.mlp.gate_up_proj.weight"].std().item()
    assert 0.018 < std < 0.022
    again = get_model_class(["Qwen2ForCausalLM"])(arch)
    init_dummy_weights(again, seed=3)
    assert torch.equal(params["model.embed_tokens.weight"],
                       dict(again.named_parameters())["model.embed_tokens.weight"])
    (logits,) = run_step(model, PagedKVCache.for_arch(arch, num_blocks=4), [(0, [1, 2, 3])])
    assert logits.shape == (3, arch.vocab_size) and torch.isfinite(logits).all()
    bf16 = build_dummy_model(arch, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
