"""Mixtral: Mistral's attention with a mixture of experts in every layer, its routing weights
a softmax over the top-k logits (the top-k probabilities renormalised)."""

from __future__ import annotations

from tokenmill.models.config import ArchConfig
from tokenmill.models.moe import ExpertNames, MoEDecoderLayer, MoEForCausalLM


class MixtralDecoderLayer(MoEDecoderLayer):
    """Mixtral's layer: the top-k routing weights always renormalised."""

    @classmethod
    def renormalize(cls, config: ArchConfig) -> bool:
        return True


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral causal LM (Mixtral-8x7B, 8x22B); checkpoint names ``block_sparse_moe.gate``
    and ``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up), ``w2`` (down)."""

    layer_cls = MixtralDecoderLayer
    expert_names = ExpertNames(prefix="block_sparse_moe", gate="w1", up="w3", down="w2")

    def __init__(self, config: ArchConfig) -> None:
        if not config.num_experts:
            raise ValueError("num_local_experts must be > 0 for MixtralForCausalLM")
        super().__init__(config)
