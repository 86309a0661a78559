"""The mixture-of-experts blocks shared by the MoE families (Qwen3-MoE, Mixtral): a router, the
experts' weights stacked per layer, the decoder layer whose feed-forward they are, and the
causal LM that loads a checkpoint's per-expert (or stacked) tensors into the stacks.

A family module says only what differs: its attention options, whether the top-k routing
weights are renormalised, and its checkpoint's names for the experts. Which kernel multiplies
the experts is bound at load (``Kernels.moe``, the grouped PyTorch path on the CPU); a
quantization pass swaps :class:`StackedExperts` for per-expert weight-only modules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.distributed import tp_size
from tokenmill.kernels.moe import torch_moe
from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM, _Target
from tokenmill.models.kernel_binding import Kernels
from tokenmill.models.layers import AttentionOptions, DecoderLayer


class Router(nn.Module):
    """The gate choosing each token's experts: softmax over ``weight @ x`` (fp32), the top
    ``top_k``, renormalised to sum to one where the family does so.

    Not an ``nn.Linear``: weight-only quantization leaves it in float, as vLLM does (a few
    thousand weights a layer, and the choice of experts is the most sensitive product).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k] float32, topk_ids [T, k] int64)`` for ``x`` ``[T, H]``."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            # Equal to a softmax over the top-k logits (Mixtral's formulation).
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def extra_repr(self) -> str:
        return (f"experts={self.weight.shape[0]}, top_k={self.top_k}, "
                f"renormalize={self.renormalize}")


class StackedExperts(nn.Module):
    """``num_experts`` SiLU-gated MLPs with their weights stacked: ``w13`` ``[E, 2I, H]`` (each
    expert's gate rows then its up rows) and ``w2`` ``[E, H, I]``. The product is the kernel
    bound at load (``Kernels.moe``)."""

    _moe = staticmethod(torch_moe)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def use_kernels(self, kernels: Kernels) -> None:
        """Multiply with ``kernels.moe`` from now on."""
        self._moe = kernels.moe

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """``[T, H]``: each token's chosen experts' outputs summed with their weights."""
        return self._moe(x, self.w13, self.w2, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """A layer's feed-forward as a mixture of experts: the router, then the experts."""

    def __init__(self, config: ArchConfig, renormalize: bool) -> None:
        super().__init__()
        self.gate = Router(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                           renormalize)
        self.experts = StackedExperts(config.num_experts, config.hidden_size,
                                      config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


class MoEDecoderLayer(DecoderLayer):
    """A pre-norm decoder layer whose feed-forward is a :class:`SparseMoeBlock` where
    ``config.is_moe_layer`` says so, else the dense gated MLP; the residual stream is carried
    as in :class:`~tokenmill.models.layers.DecoderLayer`."""

    @classmethod
    def renormalize(cls, config: ArchConfig) -> bool:
        """Whether the top-k routing weights are renormalised (Qwen3-MoE: ``norm_topk_prob``)."""
        return config.norm_topk_prob

    def make_mlp(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return SparseMoeBlock(config, self.renormalize(config))
        return super().make_mlp(config, layer_idx)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(feed-forward output, residual)`` as DecoderLayer returns them."""
        attn = self.self_attn
        qkv, residual = self.input_layernorm.linear_forward(h, residual, attn.qkv_proj)
        out = attn.attend(qkv, cos, sin, meta)
        x, residual = self.post_attention_layernorm.add_forward(out, residual)
        return self.mlp(x), residual


@dataclass(frozen=True)
class ExpertNames:
    """A family's checkpoint names for a sparse layer's block: ``model.layers.N.{prefix}``,
    holding ``gate.weight`` and ``experts.E.{gate|up|down}.weight``."""

    prefix: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


# A sparse layer's tensors under any of the names checkpoints use: transformers' per-expert
# ones, its stacked ones (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
# [E, H, I]) and the GGUF loader's (``experts.gate_proj.weight`` / ``up_proj`` [E, I, H],
# ``down_proj`` [E, H, I]).
_MOE_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(gate\.weight|experts\..+)")
_EXPERT = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
_STACKED = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


class MoEForCausalLM(DecoderForCausalLM):
    """A decoder-only LM with :class:`MoEDecoderLayer` layers; loads per-expert or stacked
    expert tensors into each layer's stacks and refuses, naming the config field, an expert
    count, width or top-k that does not fit the checkpoint."""

    layer_cls = MoEDecoderLayer
    expert_names = ExpertNames()

    def __init__(self, config: ArchConfig) -> None:
        if tp_size() > 1:
            raise ValueError(f"{config.architecture}: tensor parallelism is not supported for "
                             "mixture-of-experts models (tensor_parallel_size must be 1)")
        if config.shared_expert_intermediate_size:
            # Qwen2-MoE-style shared experts are not built here: refused, never ignored.
            raise ValueError(f"{config.architecture}: shared_expert_intermediate_size "
                             f"{config.shared_expert_intermediate_size} is not supported (the "
                             "MoE block has no shared expert)")
        super().__init__(config)

    @classmethod
    def attention_options(cls, config: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                                qk_norm=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As DecoderForCausalLM's, with a sparse layer's tensors under any of the names
        checkpoints use (see ``_MOE_TENSOR``)."""
        super().load_weights(self._expert_tensors(weights))

    def _expert_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` with stacked expert tensors split per expert and every sparse-layer
        name in this family's spelling; ValueError naming ``num_experts`` or
        ``moe_intermediate_size`` where the tensors do not fit them."""
        c, names = self.config, self.expert_names
        seen: dict[int, set[int]] = {}
        for name, tensor in weights:
            m = _MOE_TENSOR.fullmatch(name)
            if m is None or not c.is_moe_layer(int(m.group(1))):
                yield name, tensor
                continue
            layer, rest = int(m.group(1)), m.group(2)
            prefix = f"model.layers.{layer}.{names.prefix}"
            if rest == "gate.weight":
                self._check_experts(name, tensor.shape[0])
                yield f"{prefix}.gate.weight", tensor
            elif (kind := rest.removeprefix("experts.").removesuffix(".weight")) in _STACKED:
                self._check_experts(name, tensor.shape[0])
                seen.setdefault(layer, set()).update(range(tensor.shape[0]))
                yield from self._split(prefix, kind, tensor)
            elif (e := _EXPERT.fullmatch(rest)) is not None:
                expert, part = int(e.group(1)), e.group(2)
                if expert >= c.num_experts:
                    raise ValueError(f"tensor {name!r} is expert {expert}, but num_experts is "
                                     f"{c.num_experts}")
                self._check_width(name, part, tensor)
                seen.setdefault(layer, set()).add(expert)
                yield f"{prefix}.experts.{expert}.{part}.weight", tensor
            else:
                yield name, tensor  # unexpected: DecoderForCausalLM names it
        for layer, experts in seen.items():
            if len(experts) != c.num_experts:
                raise ValueError(f"num_experts is {c.num_experts}, but layer {layer} of the "
                                 f"checkpoint holds {len(experts)} experts")

    def _check_experts(self, name: str, count: int) -> None:
        if count != self.config.num_experts:
            raise ValueError(f"tensor {name!r} holds {count} experts, but num_experts is "
                             f"{self.config.num_experts}")

    def _check_width(self, name: str, part: str, tensor: torch.Tensor) -> None:
        names, inter = self.expert_names, self.config.moe_intermediate_size
        width = tensor.shape[1] if part == names.down else tensor.shape[0]
        if tensor.ndim == 2 and width != inter:
            raise ValueError(f"tensor {name!r} of shape {tuple(tensor.shape)} is {width} wide, "
                             f"but moe_intermediate_size is {inter}")

    def _split(self, prefix: str, kind: str, stacked: torch.Tensor
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert tensors of a stacked one (``kind`` one of ``_STACKED``)."""
        names = self.expert_names
        for e, t in enumerate(stacked.unbind(0)):
            base = f"{prefix}.experts.{e}"
            if kind == "gate_up_proj":
                gate, up = t.split(t.shape[0] // 2, dim=0)
                yield f"{base}.{names.gate}.weight", gate
                yield f"{base}.{names.up}.weight", up
            else:
                part = {"gate_proj": names.gate, "up_proj": names.up, "down_proj": names.down}
                yield f"{base}.{part[kind]}.weight", t

    def _hf_targets(self) -> dict[str, _Target]:
        """DecoderForCausalLM's targets, with each sparse layer's stacks addressed per expert
        and its router under the family's prefix."""
        targets = super()._hf_targets()
        names = self.expert_names
        for i, layer in enumerate(self.model.layers):
            if not isinstance(layer.mlp, SparseMoeBlock):
                continue
            ours, prefix = f"model.layers.{i}.mlp", f"model.layers.{i}.{names.prefix}"
            experts = layer.mlp.experts
            for leaf in ("experts.w13", "experts.w2", "gate.weight"):
                del targets[f"{ours}.{leaf}"]
            targets[f"{prefix}.gate.weight"] = _Target(layer.mlp.gate.weight, None,
                                                       self.config.num_experts)
            inter, hidden = experts.intermediate_size, self.config.hidden_size
            w13 = experts.w13.view(-1, hidden)  # [E * 2I, H]: expert e's rows from e * 2I
            w2 = experts.w2.view(-1, inter)  # [E * H, I]
            for e in range(experts.num_experts):
                base = f"{prefix}.experts.{e}"
                targets[f"{base}.{names.gate}.weight"] = _Target(w13, 2 * e * inter, inter)
                targets[f"{base}.{names.up}.weight"] = _Target(w13, (2 * e + 1) * inter, inter)
                targets[f"{base}.{names.down}.weight"] = _Target(w2, e * hidden, hidden)
        return targets
