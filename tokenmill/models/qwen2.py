"""Qwen2 / Qwen2.5: biases on the q/k/v projections."""

from __future__ import annotations

from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.layers import AttentionOptions


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 causal LM: always a q/k/v bias, never an output-projection bias."""

    @classmethod
    def attention_options(cls, config: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False, qk_norm=False)
