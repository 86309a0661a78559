"""Gemma 3 (text): sandwich norms, ``(1 + w)`` RMSNorm, q/k norms, a GELU-tanh gated MLP,
embeddings scaled by sqrt(hidden), and 5 local (sliding-window) : 1 global layers, each kind
with its own rope base.

Built from the shared blocks: the ``(1 + w)`` of Gemma's norms is folded into the weights at
load (``load_weights`` adds 1), so every norm is the stock :class:`RMSNorm` and takes the same
kernels; the attention is the stock one with the layer's window and Gemma's query scale.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.kernel_binding import Kernels, silu_then_down
from tokenmill.models.layers import (
    AttentionOptions,
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
)

# Gemma's norms scale by (1 + weight): these checkpoint tensors get 1 added at load.
_NORM_SUFFIX = "norm.weight"


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of the fused ``[.., gate | up]`` projection (HF's
    ``gelu_pytorch_tanh``)."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeluGatedMLP(GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))``: the gated MLP with GELU's tanh form, whose
    activation runs in PyTorch on every device (no fused kernel computes it)."""

    _act = staticmethod(gelu_tanh_mul)

    def use_kernels(self, kernels: Kernels) -> None:
        """Keep the GELU (the kernels' SiLU does not apply); the products are the layers'."""
        self._kernels = kernels
        self._act = gelu_tanh_mul
        self._act_down = silu_then_down  # (the activation is self._act, despite the name)


class Gemma3DecoderLayer(DecoderLayer):
    """Norms before and after both attention and MLP (HF's sandwich), each residual add in
    the kernel of the norm that follows it, as the stock layer does."""

    def __init__(self, config: ArchConfig, layer_idx: int, options: AttentionOptions) -> None:
        super().__init__(config, layer_idx, options)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm.feeds(self.mlp.gate_up_proj)
        attn = self.self_attn
        attn.window = config.layer_window(layer_idx)
        # A local layer: a sliding window and the local rope base.
        self.is_sliding = attn.window is not None
        if config.query_pre_attn_scalar is not None:
            attn.scale = config.query_pre_attn_scalar ** -0.5

    def make_mlp(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        return GeluGatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(post-MLP-norm output, residual)``, whose sum is the layer's output."""
        attn = self.self_attn
        qkv, residual = self.input_layernorm.linear_forward(h, residual, attn.qkv_proj)
        out = self.post_attention_layernorm(attn.attend(qkv, cos, sin, meta))
        gate_up, residual = self.pre_feedforward_layernorm.linear_forward(
            out, residual, self.mlp.gate_up_proj)
        return self.post_feedforward_layernorm(self.mlp.down(gate_up)), residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 causal LM (text only): ``Gemma3ForCausalLM`` checkpoints, and llama.cpp's
    ``gemma3`` GGUF files (model_loader/gguf.py)."""

    layer_cls = Gemma3DecoderLayer

    def __init__(self, config: ArchConfig) -> None:
        super().__init__(config)
        # The global layers take self.rotary (rope_theta, rope_scaling); the local ones this.
        self.local_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                            config.rope_local_base_freq, None)
        self.embed_scale = config.hidden_size ** 0.5

    @classmethod
    def attention_options(cls, config: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                                qk_norm=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the flattened tokens of every sequence in the step."""
        model = self.model
        dtype = model.norm.weight.dtype
        tables = {False: self.rotary.cos_sin(positions, dtype),
                  True: self.local_rotary.cos_sin(positions, dtype)}
        h = model.embed_tokens(input_ids)
        # HF scales in the activations' dtype (sqrt(640) rounds to 25.25 in bf16).
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype, device=h.device)
        residual = None
        for layer in model.layers:
            cos, sin = tables[layer.is_sliding]
            h, residual = layer(h, residual, cos, sin, attn_meta)
        return model.norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The head's logits, soft-capped by ``tanh`` where the config says so."""
        logits = super().compute_logits(hidden, float32)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face named tensors, Gemma's norm weights folded to ``1 + w``."""
        super().load_weights(_fold_norms(weights))


def _fold_norms(weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name, (tensor + 1 if name.endswith(_NORM_SUFFIX) else tensor)
