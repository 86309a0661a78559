"""Test helper: a tiny random Gemma 3 (text) checkpoint saved by transformers, and ours.

Local (sliding-window) and global layers mixed, a window of 8 tokens so that short prompts
already reach past it, each layer kind with its own rope (linear scaling on the global ones),
a query scale that is not 1/sqrt(head_dim), and a logit soft cap: every Gemma 3 feature
shows if it is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import Checkpoint, load_ours, randomize, write_tokenizer

WINDOW = 8
GEMMA3: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                 "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                        "rope_theta": 20000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
)


def make_gemma3_checkpoint(path: Path, **overrides: Any) -> Checkpoint:
    """A saved random ``Gemma3ForCausalLM`` folder (with a tokenizer), transformers' model
    read back from it in fp32 with eager attention, and ours loaded from it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(**{**GEMMA3, **overrides})
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForCausalLM(config)
    # Norm weights near 1 become (1 + w) near 2 here: far from an identity, as they should.
    randomize(hf_model, seed=11)
    hf_model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size, eos_id=1)
    hf_model = transformers.Gemma3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    model, arch = load_ours(path)
    return Checkpoint(path, hf_model, model, arch)
