"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, explicit head_dim) with a mixture of
experts as the feed-forward of its sparse layers; top-k weights renormalised where the config's
``norm_topk_prob`` says so."""

from __future__ import annotations

from tokenmill.models.config import ArchConfig
from tokenmill.models.layers import AttentionOptions
from tokenmill.models.moe import MoEForCausalLM


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE causal LM (Qwen3-30B-A3B, Qwen3-235B-A22B); checkpoint names
    ``mlp.gate`` and ``mlp.experts.N.{gate,up,down}_proj``."""

    @classmethod
    def attention_options(cls, config: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                                qk_norm=True)
