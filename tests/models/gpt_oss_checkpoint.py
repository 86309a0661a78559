"""Test helper: a tiny random gpt-oss checkpoint saved by transformers, and ours.

Sliding (window 8, so short prompts already reach past it) and full layers alternating, YaRN
rope with a factor and a pretraining context the prompts pass, random attention sinks, router
biases and expert biases, and expert weights large enough that the SwiGLU's clamps at
``swiglu_limit`` bite: every gpt-oss feature shows if it is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import Checkpoint, load_ours, randomize, write_tokenizer

WINDOW = 8
GPT_OSS: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    sliding_window=WINDOW, num_local_experts=6, num_experts_per_tok=2, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, swiglu_limit=1.5,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                         beta_slow=1.0, truncate=False, original_max_position_embeddings=16),
)


def make_gpt_oss_checkpoint(path: Path, **overrides: Any) -> Checkpoint:
    """A saved random ``GptOssForCausalLM`` folder (with a tokenizer), transformers' model
    read back from it in fp32 with eager attention, and ours loaded from it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    torch.manual_seed(0)
    hf_model = transformers.GptOssForCausalLM(config)
    randomize(hf_model, seed=21)
    with torch.no_grad():  # sinks of a few units: a large share of some rows' softmax
        for layer in hf_model.model.layers:
            layer.self_attn.sinks.mul_(15.0)
    hf_model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size)
    hf_model = transformers.GptOssForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    model, arch = load_ours(path)
    return Checkpoint(path, hf_model, model, arch)
