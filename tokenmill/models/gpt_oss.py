"""gpt-oss (``GptOssForCausalLM``, gpt-oss-20b / 120b): attention with q/k/v/o biases and a
learned sink logit per head, sliding-window (128) and full layers alternating, YaRN rope, and
a mixture of experts in every layer whose router has a bias and a softmax over the top-k
logits, and whose experts have biases and a clamped SwiGLU.

Built from the shared blocks: the stock attention with the layer's window and its sinks
(handed to the backend, which adds them to each softmax's denominator), the stock rotary with
YaRN's frequencies and attention factor (models/rope_scaling.py), and the grouped MoE kernel
of :mod:`tokenmill.kernels.moe` with the clamped SwiGLU as its activation. The checkpoint's
experts (``gate_up_proj`` ``[E, H, 2I]`` with gate and up interleaved column by column, and
``down_proj`` ``[E, I, H]``, or their MXFP4 ``_blocks`` / ``_scales``) become the stacks'
``[E, 2I, H]`` (gate rows then up rows) and ``[E, H, I]`` at load.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import tp_size
from tokenmill.kernels.moe import torch_moe
from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.kernel_binding import Kernels
from tokenmill.models.layers import AttentionOptions
from tokenmill.models.moe import MoEDecoderLayer, StackedExperts
from tokenmill.models.mxfp4 import dequantize_mxfp4

logger = logging.getLogger(__name__)

# A checkpoint's expert tensor: (layer, projection, suffix: "", "_bias", "_blocks", "_scales").
_EXPERT_TENSOR = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)")
_STACK = {"gate_up_proj": "w13", "down_proj": "w2"}


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gating of ``[.., gate | up]`` rows: ``(up + 1) * gate * sigmoid(alpha *
    gate)`` with gate clamped above at ``limit`` and up to ``[-limit, limit]``."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssRouter(nn.Module):
    """The gate choosing each token's experts: the top ``top_k`` of ``weight @ x + bias``,
    their weights a softmax over those k logits (fp32)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k] float32, topk_ids [T, k] int64)`` for ``x`` ``[T, H]``."""
        logits = F.linear(x, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32), ids


class GptOssExperts(StackedExperts):
    """The stacked experts with biases (``w13_bias`` ``[E, 2I]``, ``w2_bias`` ``[E, H]``) and
    the clamped SwiGLU (``activation``), multiplied on the grouped PyTorch path: the fused
    CUDA kernel is SiLU-gated without biases, so these experts keep the PyTorch path whatever
    kernels are bound (the model says so once, at load). Weight-only int8/int4 keeps both
    (tokenmill.quant.experts)."""

    def __init__(self, config: ArchConfig) -> None:
        super().__init__(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.w13_bias = nn.Parameter(torch.empty(config.num_experts,
                                                 2 * config.moe_intermediate_size))
        self.w2_bias = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.activation = functools.partial(clamped_swiglu, alpha=config.swiglu_alpha,
                                             limit=config.swiglu_limit)

    def use_kernels(self, kernels: Kernels) -> None:
        """Keep the grouped PyTorch path (see the class's note)."""
        self._moe = torch_moe

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """``[T, H]``: each token's chosen experts' outputs summed with their weights."""
        return torch_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.activation,
                         self.w13_bias, self.w2_bias)


class GptOssMoE(nn.Module):
    """A layer's feed-forward: the router (checkpoint name ``mlp.router``), then the experts."""

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.router = GptOssRouter(config.hidden_size, config.num_experts,
                                   config.num_experts_per_tok)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(MoEDecoderLayer):
    """A pre-norm layer: attention with sinks (and a window on the sliding layers), then the
    mixture of experts; the residual stream carried as in the stock layer."""

    def __init__(self, config: ArchConfig, layer_idx: int, options: AttentionOptions) -> None:
        super().__init__(config, layer_idx, options)
        attn = self.self_attn
        attn.window = config.layer_window(layer_idx)
        attn.sinks = nn.Parameter(torch.empty(attn.num_heads))

    def make_mlp(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        return GptOssMoE(config)


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss causal LM from a Hugging Face folder: float experts, or MXFP4 ones
    (``quantization_config.quant_method`` "mxfp4") dequantized at load."""

    layer_cls = GptOssDecoderLayer

    def __init__(self, config: ArchConfig) -> None:
        if tp_size() > 1:
            raise ValueError(f"{config.architecture}: tensor parallelism is not supported for "
                             "mixture-of-experts models (tensor_parallel_size must be 1)")
        if not config.num_experts:
            raise ValueError("num_local_experts must be > 0 for GptOssForCausalLM")
        super().__init__(config)

    @classmethod
    def attention_options(cls, config: ArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                                qk_norm=False)

    def use_kernels(self, kernels: Kernels) -> None:
        """Say at load where the experts run when the bound set has a fused MoE kernel."""
        if kernels.moe is not torch_moe:
            logger.info("gpt-oss experts: the %s kernels' fused MoE is SiLU-gated without "
                        "biases; the clamped-SwiGLU experts run on the grouped PyTorch path",
                        kernels.name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face named tensors, the experts' (float or MXFP4) in the stacks' layout;
        ValueError naming num_local_experts or intermediate_size where they do not fit."""
        super().load_weights(self._expert_tensors(weights))

    def _expert_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` with each expert tensor as the stack it fills: ``[E, out, in]`` (or a
        bias ``[E, out]``), gate_up's interleaved rows as gate's then up's; an MXFP4 pair
        dequantized once both halves came."""
        halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        dtype = self.model.norm.weight.dtype
        for name, tensor in weights:
            m = _EXPERT_TENSOR.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            layer, proj, suffix = m.groups()
            target = f"model.layers.{layer}.mlp.experts.{_STACK[proj]}"
            if suffix == "_bias":
                self._check(name, tensor, proj)
                yield f"{target}_bias", _gate_then_up(proj, tensor)
            elif suffix == "":  # float, [E, in, out]
                self._check(name, tensor, proj)
                yield target, _gate_then_up(proj, tensor.transpose(1, 2))
            else:
                pair = halves.setdefault((layer, proj), {})
                pair[suffix] = tensor
                if len(pair) == 2:
                    del halves[(layer, proj)]
                    rows = dequantize_mxfp4(pair["_blocks"], pair["_scales"], dtype)
                    self._check(name, rows.transpose(1, 2), proj)
                    yield target, _gate_then_up(proj, rows)
        for (layer, proj), pair in halves.items():
            raise ValueError(f"model.layers.{layer}.mlp.experts.{proj}{next(iter(pair))} came "
                             "without its other half (MXFP4 _blocks and _scales go together)")

    def _check(self, name: str, tensor: torch.Tensor, proj: str) -> None:
        """A float ``[E, in, out]`` expert tensor's (or ``[E, out]`` bias's) expert count and
        width against the config, naming the field that does not fit."""
        c = self.config
        if tensor.shape[0] != c.num_experts:
            raise ValueError(f"tensor {name!r} holds {tensor.shape[0]} experts, but "
                             f"num_local_experts is {c.num_experts}")
        if proj == "gate_up_proj":
            width, want = tensor.shape[-1], 2 * c.moe_intermediate_size
        elif tensor.ndim == 3:
            width, want = tensor.shape[1], c.moe_intermediate_size
        else:
            return  # down's bias is hidden_size wide: the loader's shape check names it
        if width != want:
            raise ValueError(f"tensor {name!r} of shape {tuple(tensor.shape)} is {width} wide, "
                             f"but intermediate_size is {c.moe_intermediate_size} (experts of "
                             f"{want} there)")


def _gate_then_up(proj: str, tensor: torch.Tensor) -> torch.Tensor:
    """gate_up's entries along dim 1, interleaved (gate, up, gate, ...) in the checkpoint
    (transformers' ``gate_up[..., ::2]`` / ``[..., 1::2]``), as gate's then up's."""
    if proj != "gate_up_proj":
        return tensor
    return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
