"""Llama (and Mistral): attention biases as the config says, no q/k norms."""

from __future__ import annotations

from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.layers import AttentionOptions


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama causal LM: q/k/v and output biases both follow ``attention_bias``."""

    @classmethod
    def attention_options(cls, config: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                                qk_norm=False)
