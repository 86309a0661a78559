"""Building blocks shared by the decoder-only families: norm, rotary, MLP, attention, layer stack."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.distributed import tensor_model_parallel_all_reduce, tp_rank, tp_size
from tokenmill.kernels.fp8_activation import QuantizedActivation
from tokenmill.models.config import ArchConfig
from tokenmill.models.linear import linear, norm_linear, silu_mul_linear
from tokenmill.models.parallel import VocabParallelEmbedding, divide
from tokenmill.utils import triton_module


class Linear(nn.Linear):
    """``nn.Linear`` that skips the random init: weights are loaded or dummy-filled later.

    Kaiming init of an 8B model costs tens of seconds on CPU only to be overwritten. The
    product is :func:`tokenmill.models.linear.linear`'s: on a GPU, cuBLAS or a tuned Triton
    matmul.
    """

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor, norm: tuple[RMSNorm, torch.Tensor | None] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The product of ``x``; with ``norm`` (an RMSNorm and a residual, or None), the product
        of ``norm(x + residual)`` and that sum, as :meth:`RMSNorm.linear_forward` returns them:
        in one kernel where the Triton matmul computes this product, else the norm's kernel
        first. (A call, not two, so that the module's hooks see the product either way.)"""
        if norm is None:
            return linear(x, self.weight, self.bias)
        rms, residual = norm
        if (fused := norm_linear(x, residual, rms.weight, rms.eps, self.weight,
                                 self.bias)) is not None:
            return fused
        y, summed = rms.add_forward(x, residual)
        return linear(y, self.weight, self.bias), summed


class Bf16MatmulLinear(nn.Module):
    """A linear layer whose product runs in bf16 while everything around it stays fp32.

    The input is rounded to bf16 for the matmul (oneDNN's AVX512-BF16 / AMX kernels, ~4x the
    fp32 GEMM rate on CPUs that have them), the product comes back in fp32 and the fp32 bias
    is added there. Only the matmul's operands lose precision: residuals, norms, softmax and
    pooling keep fp32, which is what keeps an encoder's embeddings within 1e-4 cosine of the
    fp32 reference (full bf16 does not: benchmarks/results/embed-avx512bf16-cpu.json).
    """

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.out_dtype = out_dtype
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().to(out_dtype), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.out_dtype == torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight).to(self.out_dtype)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, matmul=bfloat16")


class Embedding(nn.Embedding):
    """``nn.Embedding`` that skips the random init, for the same reason as :class:`Linear`."""

    def reset_parameters(self) -> None:
        pass


def cuda_kernels(x: torch.Tensor) -> ModuleType | None:
    """:mod:`tokenmill.kernels.triton.fused_ops` for a CUDA tensor when Triton is installed, else None.

    Imported on first use, so a CPU run never imports Triton."""
    return triton_module("tokenmill.kernels.triton.fused_ops") if x.is_cuda else None


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32 like Hugging Face's."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)
        # Set by the fp8 quantization pass when the layer reading the output is an Fp8Linear:
        # on CUDA the kernel then hands it over quantized (one kernel fewer); elsewhere no-op.
        self.fp8_out = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        if x.ndim == 2 and (ops := cuda_kernels(x)) is not None:
            norm = ops.rms_norm_fp8 if self.fp8_out else ops.rms_norm
            return norm(x, self.weight, self.eps)[0]
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Low-precision inputs: normalize in fp32, scale in the input dtype, as HF does.
        y = F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
        return y * self.weight

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """``(norm(residual + x), residual + x)`` (residual None: ``(norm(x), x)``): one kernel
        on CUDA. The sum is rounded to the activations' dtype before the norm, as the eager
        add rounds it."""
        if x.ndim == 2 and (ops := cuda_kernels(x)) is not None:
            norm = ops.rms_norm_fp8 if self.fp8_out else ops.rms_norm
            return norm(x, self.weight, self.eps, residual=residual)
        h = x if residual is None else residual + x
        return self(h), h

    def linear_forward(self, x: torch.Tensor, residual: torch.Tensor | None, layer: nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layer(norm(residual + x)), residual + x)`` (residual None: of ``x`` itself). Where
        ``layer`` is a 16-bit :class:`Linear` whose product runs on the Triton matmul (a
        decode step's few rows on a GPU whose tuning says so), the norm and the add are
        computed in the product's kernel: no norm kernel is launched."""
        if type(layer) is Linear and not self.fp8_out:
            return layer(x, norm=(self, residual))
        y, summed = self.add_forward(x, residual)
        return layer(y), summed


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation frequencies ``[head_dim // 2]`` (fp32), with optional context scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    try:
        factor = float(scaling["factor"])  # type: ignore[index]
        if rope_type == "linear":
            return inv_freq / factor
        if rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, factor, float(scaling["low_freq_factor"]),  # type: ignore[index]
                                    float(scaling["high_freq_factor"]),  # type: ignore[index]
                                    int(scaling["original_max_position_embeddings"]))  # type: ignore[index]
    except KeyError as e:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {e.args[0]!r}") from None
    raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                     high_freq_factor: float, old_context_len: int) -> torch.Tensor:
    # Same formula as transformers' _compute_llama3_parameters: long wavelengths are slowed by
    # `factor`, short ones kept, and the band between them interpolated smoothly.
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout) with a cos/sin table for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # Half-width tables in fp32; widened once per step in cos_sin(), not per layer.
        self.register_buffer("cos_half", freqs.cos(), persistent=False)
        self.register_buffer("sin_half", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, head_dim]`` cos and sign-folded sin for :func:`apply_rotary`."""
        cos = self.cos_half.index_select(0, positions)
        sin = self.sin_half.index_select(0, positions)
        cos = torch.cat([cos, cos], dim=-1).to(dtype).unsqueeze(1)
        sin = torch.cat([-sin, sin], dim=-1).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]``: ``x * cos + rotate_half(x) * sin`` in three kernels.

    ``sin`` comes with its first half negated, so ``rotate_half(x) * sin`` is a plain swap of
    the halves times it.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul.

    Under tensor parallelism each rank holds ``intermediate_size / tp`` columns of gate and up
    and the matching rows of down; the all-reduce adds the partial outputs. A down bias lives
    on rank 0 only, so it is added once.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_size = tp_size()
        self.intermediate_size = divide(intermediate_size, self.tp_size, "intermediate_size")
        self.gate_up_proj = Linear(hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = Linear(self.intermediate_size, hidden_size,
                                bias=bias and tp_rank() == 0)
        # Set by the fp8 quantization pass when down_proj is an Fp8Linear: on CUDA the
        # SiLU-and-mul kernel then hands its output over quantized; elsewhere no-op.
        self.fp8_act = False

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The down projection of ``silu(gate) * up`` from gate_up's output (all-reduced under
        tensor parallelism)."""
        if type(self.down_proj) is Linear and (
                out := silu_mul_linear(gate_up, self.down_proj.weight,
                                       self.down_proj.bias)) is not None:
            # A decode step's few rows on a GPU whose tuning says so: the SiLU in the down
            # projection's kernel.
            return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out
        act: torch.Tensor | QuantizedActivation
        if gate_up.ndim == 2 and (ops := cuda_kernels(gate_up)) is not None:
            act = ops.silu_and_mul_fp8(gate_up) if self.fp8_act else ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        out = self.down_proj(act)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


@dataclass(frozen=True)
class AttentionOptions:
    """Where the families differ inside the attention block."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)


class Attention(nn.Module):
    """Self-attention with fused q/k/v projection; the attention itself is the backend's.

    Under tensor parallelism each rank holds ``heads / tp`` query and KV heads (its KV cache
    too) and the matching input rows of o_proj; the all-reduce adds the partial outputs. An
    o_proj bias lives on rank 0 only, so it is added once.
    """

    def __init__(self, config: ArchConfig, layer_idx: int, options: AttentionOptions) -> None:
        super().__init__()
        self.tp_size = tp_size()
        self.layer_idx = layer_idx
        self.num_heads = divide(config.num_attention_heads, self.tp_size, "num_attention_heads")
        self.num_kv_heads = divide(config.num_key_value_heads, self.tp_size,
                                   "num_key_value_heads")
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=options.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size,
                             bias=options.o_bias and tp_rank() == 0)
        self.qk_norm = options.qk_norm
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor | QuantizedActivation, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), cos, sin, meta)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """The block's output from qkv_proj's: norms of q and k (Qwen3), rotary, the
        backend's attention, o_proj (all-reduced under tensor parallelism)."""
        num_tokens = qkv.shape[0]
        hq = self.num_heads
        # q and k are rotated together: one set of rope kernels instead of two.
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, hq + self.num_kv_heads,
                                                      self.head_dim)
        if self.qk_norm:
            if qk.stride(2) == 1 and (ops := cuda_kernels(qk)) is not None:
                ops.head_rms_norm_(qk, self.q_norm.weight, self.k_norm.weight, hq,
                                   self.q_norm.eps)  # in place, one kernel
            else:
                qk = torch.cat([self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        backend, cache = meta.backend, meta.kv_caches[self.layer_idx]
        if backend.fuses_rotary:  # rotated in the kernel that stores K/V
            out = backend.forward_rotary(qk[:, :hq], qk[:, hq:], v, cache, meta, self.scale,
                                         cos, sin)
        else:
            if qk.stride(2) == 1 and (ops := cuda_kernels(qk)) is not None:
                qk = ops.rotary_(qk, cos, sin)  # in place, one kernel
            else:
                qk = apply_rotary(qk, cos, sin)
            out = backend.forward(qk[:, :hq], qk[:, hq:], v, cache, meta, self.scale)
        out = self.o_proj(out)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then gated MLP, each with a residual add.

    The residual stream is carried beside the block's output, not added to it (vLLM's
    layout): each residual add happens inside the kernel of the norm that follows it, the
    next layer's input norm or the model's final norm, so no layer needs an add of its own.
    """

    def __init__(self, config: ArchConfig, layer_idx: int, options: AttentionOptions) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``, whose sum is the layer's output; ``h`` is the previous
        layer's mlp output, or with ``residual`` None (the first layer) the embeddings."""
        # Each norm hands its output to the projection after it in one call: a decode step's
        # few rows on a GPU may compute the norm in the projection's kernel.
        attn = self.self_attn
        qkv, residual = self.input_layernorm.linear_forward(h, residual, attn.qkv_proj)
        out = attn.attend(qkv, cos, sin, meta)
        gate_up, residual = self.post_attention_layernorm.linear_forward(
            out, residual, self.mlp.gate_up_proj)
        return self.mlp.down(gate_up), residual


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ArchConfig, options: AttentionOptions) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, options) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, meta)
        # The last layer's residual add, in the final norm's kernel.
        return self.norm.add_forward(h, residual)[0]
