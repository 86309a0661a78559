"""Building blocks shared by the decoder-only families: norm, rotary, MLP, attention, layer stack."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.distributed import tensor_model_parallel_all_reduce, tp_rank, tp_size
from tokenmill.kernels.fp8_activation import QuantizedActivation
from tokenmill.models.config import ArchConfig
from tokenmill.models.kernel_binding import (
    TORCH_KERNELS,
    Kernels,
    norm_then_linear,
    silu_then_down,
    torch_add_rms_norm,
    torch_qk_norm,
    torch_rotary,
    torch_silu_mul,
)
from tokenmill.models.parallel import VocabParallelEmbedding, divide
from tokenmill.models.rope_scaling import (
    longrope_inv_freq,
    rope_attention_factor,
    yarn_inv_freq,
)

# Rotary of ``x`` ``[T, H, D]`` by sign-folded sin, in three kernels (kernel_binding).
apply_rotary = torch_rotary


class Linear(nn.Linear):
    """``nn.Linear`` that skips the random init: weights are loaded or dummy-filled later.

    Kaiming init of an 8B model costs tens of seconds on CPU only to be overwritten. The
    product is the kernel bound at load (:mod:`tokenmill.models.kernel_binding`): on a GPU,
    cuBLAS or a tuned Triton matmul.
    """

    def reset_parameters(self) -> None:
        pass

    # The product's kernel (kernel_binding): F.linear until the model's kernels are bound.
    _product = staticmethod(F.linear)

    def use_kernels(self, kernels: Kernels) -> None:
        """Compute the product with ``kernels.linear`` from now on."""
        self._product = kernels.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias``. (Bound to the Triton kernels, ``x`` may also be a
        ``linear.NormedInput`` handed over by the norm before this layer.)"""
        return self._product(x, self.weight, self.bias)


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


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32 like Hugging Face's.

    Its kernels are bound once (:meth:`use_kernels`, re-chosen when ``fp8_out`` changes):
    ``_norm`` (the add and the norm), ``_norm_linear`` (the norm handed to the next layer).
    """

    _kernels = TORCH_KERNELS
    _norm = staticmethod(torch_add_rms_norm)
    _norm_linear = staticmethod(norm_then_linear)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)
        self._fp8_out = False
        # The layer reading this norm's output, in a tuple so that it is no submodule.
        self._feeds: tuple[nn.Module, ...] = ()

    @property
    def fp8_out(self) -> bool:
        """Set by the fp8 quantization pass when the layer reading the output is an
        Fp8Linear: with the Triton kernels the norm then hands it over quantized (one kernel
        fewer); with PyTorch's, no change."""
        return self._fp8_out

    @fp8_out.setter
    def fp8_out(self, on: bool) -> None:
        self._fp8_out = bool(on)
        self.use_kernels(self._kernels)

    def feeds(self, layer: nn.Module) -> None:
        """Say which layer reads this norm's output (for a kernel computing both)."""
        self._feeds = (layer,)
        self.use_kernels(self._kernels)

    def use_kernels(self, kernels: Kernels) -> None:
        """Run ``kernels``' norm from now on; and where they compute a norm in a 16-bit
        :class:`Linear`'s product and that Linear reads this norm in float, that kernel."""
        self._kernels = kernels
        self._norm = kernels.rms_norm_fp8 if self._fp8_out else kernels.rms_norm
        nxt = self._feeds[0] if self._feeds else None
        if kernels.norm_linear is not None and type(nxt) is Linear and not self._fp8_out:
            self._norm_linear = functools.partial(kernels.norm_linear, nxt)
        else:
            self._norm_linear = norm_then_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        return self._norm(x, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """``(norm(residual + x), residual + x)`` (residual None: ``(norm(x), x)``): one kernel
        with the Triton kernels. The sum is rounded to the activations' dtype before the norm,
        as the eager add rounds it."""
        return self._norm(x, self.weight, self.eps, residual)

    def linear_forward(self, x: torch.Tensor, residual: torch.Tensor | None, layer: nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layer(norm(residual + x)), residual + x)`` (residual None: of ``x`` itself). Bound
        to the Triton kernels with ``layer`` the 16-bit :class:`Linear` it was bound for, the
        norm and the add may run in the product's kernel (a decode step's few rows on a GPU
        whose tuning says so): no norm kernel is launched."""
        return self._norm_linear(self, x, residual, layer)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int = 0) -> torch.Tensor:
    """Per-pair rotation frequencies ``[head_dim // 2]`` (fp32), with optional context scaling
    (longrope's factors are chosen by the context served, ``max_positions``)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    try:
        if rope_type == "longrope":
            return longrope_inv_freq(head_dim, theta, scaling, max_positions)  # type: ignore[arg-type]
        if rope_type == "yarn":
            return yarn_inv_freq(head_dim, theta, scaling)  # type: ignore[arg-type]
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
    """Rotary position embedding (rotate-half layout) with a cos/sin table for every position.

    With ``rotary_dim`` below ``head_dim`` (partial rotary) the pairs past ``rotary_dim // 2``
    keep cos 1 and sin 0: the q/k rows are reordered at load so that this equals the partial
    rope (models/rope_scaling.py). Longrope's attention factor scales the turned pairs."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, rotary_dim: int | None = None) -> None:
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        scale = rope_attention_factor(scaling)
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        passed = (head_dim - rotary_dim) // 2
        if passed:
            cos = torch.cat([cos, torch.ones(max_positions, passed, dtype=cos.dtype)],
                            dim=-1)
            sin = torch.cat([sin, torch.zeros(max_positions, passed, dtype=sin.dtype)],
                            dim=-1)
        # Half-width tables in fp32; widened once per step in cos_sin(), not per layer.
        self.register_buffer("cos_half", cos, persistent=False)
        self.register_buffer("sin_half", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, head_dim]`` cos and sign-folded sin for :func:`apply_rotary`."""
        cos = self.cos_half.index_select(0, positions)
        sin = self.sin_half.index_select(0, positions)
        cos = torch.cat([cos, cos], dim=-1).to(dtype).unsqueeze(1)
        sin = torch.cat([-sin, sin], dim=-1).to(dtype).unsqueeze(1)
        return cos, sin


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul.

    Under tensor parallelism each rank holds ``intermediate_size / tp`` columns of gate and up
    and the matching rows of down; the all-reduce adds the partial outputs. A down bias lives
    on rank 0 only, so it is added once. Kernels (``_act``, ``_act_down``): :meth:`use_kernels`.
    """

    _kernels = TORCH_KERNELS
    _act = staticmethod(torch_silu_mul)
    _act_down = staticmethod(silu_then_down)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_size = tp_size()
        self.intermediate_size = divide(intermediate_size, self.tp_size, "intermediate_size")
        self.gate_up_proj = Linear(hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = Linear(self.intermediate_size, hidden_size,
                                bias=bias and tp_rank() == 0)
        self._fp8_act = False

    @property
    def fp8_act(self) -> bool:
        """Set by the fp8 quantization pass when down_proj is an Fp8Linear: with the Triton
        kernels the SiLU-and-mul then hands its output over quantized; with PyTorch's, no
        change."""
        return self._fp8_act

    @fp8_act.setter
    def fp8_act(self, on: bool) -> None:
        self._fp8_act = bool(on)
        self.use_kernels(self._kernels)

    def use_kernels(self, kernels: Kernels) -> None:
        """Run ``kernels``' SiLU-and-mul from now on (its fp8 one for an Fp8Linear down_proj),
        and where they compute it in a 16-bit down projection's product, that kernel."""
        self._kernels = kernels
        self._act = kernels.silu_mul_fp8 if self._fp8_act else kernels.silu_mul
        if kernels.silu_down is not None and type(self.down_proj) is Linear:
            self._act_down = functools.partial(kernels.silu_down, self.down_proj)
        else:
            self._act_down = silu_then_down

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The down projection of ``silu(gate) * up`` from gate_up's output (all-reduced under
        tensor parallelism)."""
        out = self._act_down(self, gate_up)
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

    _qk_norm = staticmethod(torch_qk_norm)
    _rotary = staticmethod(torch_rotary)
    # A sliding-window layer's window in tokens, handed to the backend with each call
    # (None: full attention); set by a family with such layers (models/gemma3.py).
    window: int | None = None

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
        # A learned logit per query head added to the softmax's denominator, handed to the
        # backend with each call (None: none); set by a family with sinks (models/gpt_oss.py).
        self.sinks: nn.Parameter | None = None
        self.qk_norm = options.qk_norm
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def use_kernels(self, kernels: Kernels) -> None:
        """Run ``kernels``' per-head q/k norm and rotary from now on."""
        self._qk_norm = kernels.qk_norm
        self._rotary = kernels.rotary

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
            qk = self._qk_norm(qk, self.q_norm, self.k_norm, hq)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        backend, cache = meta.backend, meta.kv_caches[self.layer_idx]
        if backend.fuses_rotary:  # rotated in the kernel that stores K/V
            out = backend.forward_rotary(qk[:, :hq], qk[:, hq:], v, cache, meta, self.scale,
                                         cos, sin, window=self.window, sinks=self.sinks)
        else:
            qk = self._rotary(qk, cos, sin)
            out = backend.forward(qk[:, :hq], qk[:, hq:], v, cache, meta, self.scale,
                                  window=self.window, sinks=self.sinks)
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
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm.feeds(self.self_attn.qkv_proj)
        if isinstance(self.mlp, GatedMLP):
            self.post_attention_layernorm.feeds(self.mlp.gate_up_proj)

    def make_mlp(self, config: ArchConfig, layer_idx: int) -> nn.Module:
        """The layer's feed-forward block: a gated MLP (a layer type may build another, such
        as the mixture of experts of models/moe.py, and say its own forward)."""
        return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

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

    def __init__(self, config: ArchConfig, options: AttentionOptions,
                 layer_cls: type[DecoderLayer] | None = None) -> None:
        super().__init__()
        layer_cls = layer_cls or DecoderLayer  # a family may say another layer type
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer_cls(config, i, options) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, meta)
        # The last layer's residual add, in the final norm's kernel.
        return self.norm.add_forward(h, residual)[0]
