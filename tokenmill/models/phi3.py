"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): the Llama blocks without biases; the checkpoint
stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``, which are split here
into the parts the shared loader knows. Partial rotary (Phi-4-mini) and longrope (the 128k
models) are the shared rotary's (models/rope_scaling.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.layers import AttentionOptions
from tokenmill.models.rope_scaling import partial_rotary_row_order, reorder_head_rows

# A fused checkpoint tensor: (layer prefix, fused module, weight or bias).
_FUSED = re.compile(r"(.+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)")


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 / Phi-4 causal LM: no biases, no q/k norms."""

    partial_rotary = True  # _split_fused reorders the q/k rows

    @classmethod
    def attention_options(cls, config: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=False, o_bias=False, qk_norm=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a Phi-3 checkpoint: its fused tensors are split into q/k/v and gate/up first
        (a fused tensor of the wrong size is named by its own name); with partial rotary the
        q and k rows of a fused qkv_proj are reordered within each head (rope_scaling.py).
        Split q/k/v tensors (a GGUF file's, ``GGUFModel``) come in the model's order already."""
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        parts = {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv),
                                        ("self_attn.v_proj", kv)),
                 "mlp.gate_up_proj": (("mlp.gate_proj", c.intermediate_size),
                                      ("mlp.up_proj", c.intermediate_size))}
        for name, tensor in weights:
            m = _FUSED.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            layer, fused, leaf = m.groups()
            split = parts[fused]
            rows = [n for _, n in split]
            if tensor.shape[0] != sum(rows):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{sum(rows)} rows ({' + '.join(f'{p} {n}' for p, n in split)})")
            for (part, _), piece in zip(split, tensor.split(rows), strict=True):
                yield f"{layer}.{part}.{leaf}", self._rotary_rows(part, piece)

    def _rotary_rows(self, part: str, rows: torch.Tensor) -> torch.Tensor:
        """q / k rows in partial rotary's order (every other part, and whole-head rope: as
        they are)."""
        c = self.config
        heads = {"self_attn.q_proj": c.num_attention_heads,
                 "self_attn.k_proj": c.num_key_value_heads}.get(part)
        if heads is None or c.rotary_dim == c.head_dim:
            return rows
        return reorder_head_rows(rows, heads, partial_rotary_row_order(c.head_dim, c.rotary_dim))
