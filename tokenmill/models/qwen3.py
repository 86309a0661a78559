"""Qwen3: per-head RMSNorm of q and k before rope, and an explicit head_dim."""

from __future__ import annotations

from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.layers import AttentionOptions


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 (dense) causal LM; ``head_dim`` comes from the config, not hidden / heads."""

    @classmethod
    def attention_options(cls, config: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                                qk_norm=True)
