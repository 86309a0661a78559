"""Test helper: tiny random Hugging Face checkpoints of every family, and our model for each."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tokenmill.model_loader.hf import iter_safetensors, load_hf_config
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class

COMMON: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, max_position_embeddings=256,
                              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

# family -> (transformers config class, extra config kwargs)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=32))),
    "llama_tied": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "mistral": ("MistralConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, sliding_window=None,
        tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
}


@dataclass
class Checkpoint:
    """A saved HF model folder, the HF reference model and our model loaded from the folder."""

    path: Path
    hf_model: nn.Module
    model: nn.Module
    arch: ArchConfig


def randomize(model: nn.Module, seed: int) -> None:
    """Weights far from HF's init (zero biases, unit norms) so that loading bugs show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)


def load_ours(path: Path) -> tuple[nn.Module, ArchConfig]:
    """Our model for an HF folder, through the same calls the engine's loader makes."""
    arch = ArchConfig.from_hf_dict(load_hf_config(path))
    model = get_model_class([arch.architecture])(arch)
    model.load_weights(iter_safetensors(path))
    return model.eval(), arch


def make_checkpoint(family: str, path: Path) -> Checkpoint:
    transformers = pytest.importorskip("transformers")
    config_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    model_cls = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))
    hf_model = model_cls(config)
    randomize(hf_model, seed=sorted(FAMILIES).index(family))
    hf_model.eval()
    hf_model.save_pretrained(path)
    hf_model = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf_model.eval()
    model, arch = load_ours(path)
    return Checkpoint(path, hf_model, model, arch)


def write_tokenizer(path: Path, vocab_size: int = 256, eos_id: int = 2) -> None:
    """A word-level tokenizer.json ("t0".."tN") next to a checkpoint; the engine needs one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t1", "eos_token": f"t{eos_id}"}))
