"""A model's module tree lowered to an op program for the CPU (``op_program.cpp``).

Each shared block of :mod:`tokenmill.models.layers` (and the decoder-only LM of
:mod:`tokenmill.models.decoder`) has one lowering here, which emits the typed ops that compute
what its ``forward`` computes: a family built from these blocks gets a program with no code of
its own. A block of a type with no lowering, or one that overrides a method the lowering
repeats, raises :class:`UnsupportedModel` naming it, when the model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.models import layers
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.gemma3 import GeluGatedMLP, Gemma3DecoderLayer, Gemma3ForCausalLM
from tokenmill.runner.cpu_linear import LinearParts, UnsupportedModel, linear_parts

# Buffer dtype classes, as in op_program.cpp: the activations' dtype, the projections' one.
ACT, IO = 0, 1


@dataclass(frozen=True)
class BufferSpec:
    """One per-step buffer: ``width`` columns, a row per token, in dtype class ``cls``."""

    name: str
    width: int
    cls: int


@dataclass(frozen=True, eq=False)
class RmsNorm:
    """dst = rms_norm(src) * weight."""

    src: int
    dst: int
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class Add:
    """dst += src: a residual add."""

    dst: int
    src: int


@dataclass(frozen=True, eq=False)
class Linear:
    """dst = module(src); ``module`` is the model's own (LoRA finds its op by it)."""

    src: int
    dst: int
    parts: LinearParts
    module: nn.Module
    path: str


@dataclass(frozen=True, eq=False)
class RopeStoreKV:
    """From q/k/v src: queries (optionally normed per head, rotated) into dst; keys (the
    same) and values stored into KV cache ``cache``."""

    src: int
    dst: int
    cache: int
    heads: int
    kv_heads: int
    head_dim: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    cos_half: torch.Tensor
    sin_half: torch.Tensor


@dataclass(frozen=True)
class Attention:
    """dst = attention of queries src over KV cache ``cache``; ``window`` > 0: each query over
    the keys of its last ``window`` positions only (a sliding-window layer)."""

    src: int
    dst: int
    cache: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int = 0


@dataclass(frozen=True)
class SiluMul:
    """dst = silu(gate) * up of each row [gate | up] of src."""

    src: int
    dst: int


@dataclass(frozen=True)
class GeluTanhMul:
    """dst = gelu_tanh(gate) * up of each row [gate | up] of src."""

    src: int
    dst: int


@dataclass(frozen=True)
class Scale:
    """dst *= factor, in place (scaled embeddings)."""

    dst: int
    factor: float


Op = RmsNorm | Add | Linear | RopeStoreKV | Attention | SiluMul | GeluTanhMul | Scale


@dataclass
class ProgramBuilder:
    """What the lowerings emit into: buffers by name (one per name and width, shared by every
    layer that asks for it: one allocation a step) and the ops in order."""

    dtype: torch.dtype = torch.float32
    buffers: list[BufferSpec] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 cos / sin half tables
    io: tuple[int, int] | None = None  # the input and output buffers
    embed: nn.Module | None = None  # the token embedding module
    head: nn.Module | None = None  # the output head, where the logits are a plain product

    def buffer(self, name: str, width: int, cls: int) -> int:
        """The buffer called ``name`` of this width and class, made on first use."""
        for i, b in enumerate(self.buffers):
            if b.name == name and b.width == width and b.cls == cls:
                return i
        self.buffers.append(BufferSpec(name, width, cls))
        return len(self.buffers) - 1

    def lower(self, module: nn.Module, path: str, *args: object, **kwargs: object) -> int:
        """Emit ``module``'s ops by its type's lowering; returns its output buffer."""
        lowering = lowering_for(module, path)
        return lowering(module, self, path, *args, **kwargs)

    def linear(self, module: nn.Module, path: str, src: int, out: str) -> int:
        """Emit a projection into buffer ``out``."""
        parts = linear_parts(module, self.dtype)
        dst = self.buffer(out, parts.out_features(), IO)
        self.ops.append(Linear(src, dst, parts, module, path))
        return dst

    def weight(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        """A norm's weight, which the program reads in the activations' dtype."""
        if tensor.dtype != self.dtype:
            raise UnsupportedModel(f"{path}: norm weight in {tensor.dtype}, activations in "
                                   f"{self.dtype}")
        return tensor.contiguous()


Lowering = Callable[..., int]
# Block type -> (the methods its lowering repeats, the lowering).
_LOWERINGS: dict[type, tuple[tuple[str, ...], Lowering]] = {}


def lowering(cls: type, *methods: str) -> Callable[[Lowering], Lowering]:
    """Register the lowering of block type ``cls``, which repeats ``methods`` of it."""
    def register(fn: Lowering) -> Lowering:
        _LOWERINGS[cls] = (methods, fn)
        return fn
    return register


def lowering_for(module: nn.Module, path: str) -> Lowering:
    """The lowering of ``module``'s nearest registered type; UnsupportedModel where there is
    none or where the module overrides a method that lowering repeats."""
    for cls in type(module).__mro__:
        if cls in _LOWERINGS:
            methods, fn = _LOWERINGS[cls]
            for name in methods:
                if getattr(type(module), name) is not getattr(cls, name):
                    raise UnsupportedModel(f"{path} ({type(module).__name__}) overrides "
                                           f"{cls.__name__}.{name}, which the CPU program "
                                           "repeats")
            return fn
    raise UnsupportedModel(f"{path}: no CPU program lowering for block type "
                           f"{type(module).__name__}")


def _single_rank(module: nn.Module, path: str) -> None:
    if getattr(module, "tp_size", 1) != 1:
        raise UnsupportedModel(f"{path}: tensor-parallel blocks have no CPU program")


@lowering(DecoderForCausalLM, "forward")
def _lower_causal_lm(model: DecoderForCausalLM, b: ProgramBuilder, path: str) -> int:
    _single_rank(model, path)
    b.dtype = model.model.norm.weight.dtype  # what forward computes the rope tables in
    b.lower(model.rotary, "rotary")
    h = b.buffer("h", model.config.hidden_size, ACT)
    out = b.lower(model.model, "model", h)
    b.io = (h, out)
    if type(model).compute_logits is DecoderForCausalLM.compute_logits:
        b.head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    return out


@lowering(layers.RotaryEmbedding, "cos_sin")
def _lower_rotary(rotary: layers.RotaryEmbedding, b: ProgramBuilder, path: str) -> int:
    # model.to(bf16) rounds the tables too; float() is exact then.
    b.rope = (rotary.cos_half.float().contiguous(), rotary.sin_half.float().contiguous())
    return -1


@lowering(layers.DecoderModel, "forward")
def _lower_decoder_model(model: layers.DecoderModel, b: ProgramBuilder, path: str,
                         h: int) -> int:
    b.embed = model.embed_tokens
    for i, layer in enumerate(model.layers):
        b.lower(layer, f"{path}.layers.{i}", h)
    return b.lower(model.norm, f"{path}.norm", h, out="out", cls=ACT)


@lowering(layers.DecoderLayer, "forward")
def _lower_decoder_layer(layer: layers.DecoderLayer, b: ProgramBuilder, path: str,
                         h: int) -> int:
    x = b.lower(layer.input_layernorm, f"{path}.input_layernorm", h)
    b.ops.append(Add(h, b.lower(layer.self_attn, f"{path}.self_attn", x)))
    x = b.lower(layer.post_attention_layernorm, f"{path}.post_attention_layernorm", h)
    b.ops.append(Add(h, b.lower(layer.mlp, f"{path}.mlp", x)))
    return h


@lowering(layers.RMSNorm, "forward", "add_forward", "linear_forward")
def _lower_rms_norm(norm: layers.RMSNorm, b: ProgramBuilder, path: str, src: int,
                    out: str = "x", cls: int = IO) -> int:
    dst = b.buffer(out, norm.weight.shape[0], cls)
    b.ops.append(RmsNorm(src, dst, b.weight(norm.weight, path), float(norm.eps)))
    return dst


@lowering(layers.Attention, "forward", "attend")
def _lower_attention(attn: layers.Attention, b: ProgramBuilder, path: str, src: int) -> int:
    _single_rank(attn, path)
    if b.rope is None:
        raise UnsupportedModel(f"{path}: attention without a rotary embedding")
    if getattr(attn, "sinks", None) is not None:  # no sink logits in the program's softmax
        raise UnsupportedModel(f"{path}: attention sinks")
    qkv = b.linear(attn.qkv_proj, f"{path}.qkv_proj", src, "qkv")
    q_norm = k_norm = None
    eps = 0.0
    if attn.qk_norm:
        for name in ("q_norm", "k_norm"):
            lowering_for(getattr(attn, name), f"{path}.{name}")  # a stock RMSNorm
        q_norm = b.weight(attn.q_norm.weight, f"{path}.q_norm")
        k_norm = b.weight(attn.k_norm.weight, f"{path}.k_norm")
        if attn.q_norm.eps != attn.k_norm.eps:
            raise UnsupportedModel(f"{path}: q and k norms with different eps")
        eps = float(attn.q_norm.eps)
    geometry = (attn.layer_idx, attn.num_heads, attn.num_kv_heads, attn.head_dim)
    q = b.buffer("q", attn.q_size, ACT)
    b.ops.append(RopeStoreKV(qkv, q, *geometry, q_norm, k_norm, eps, *b.rope))
    out = b.buffer("attn", attn.q_size, IO)
    b.ops.append(Attention(q, out, *geometry, float(attn.scale), attn.window or 0))
    return b.linear(attn.o_proj, f"{path}.o_proj", out, "o")


# "_act": a subclass with another activation needs a lowering of its own (GeluGatedMLP's).
@lowering(layers.GatedMLP, "forward", "down", "_act")
def _lower_gated_mlp(mlp: layers.GatedMLP, b: ProgramBuilder, path: str, src: int,
                     act_op: type[SiluMul] | type[GeluTanhMul] = SiluMul) -> int:
    _single_rank(mlp, path)
    gate_up = b.linear(mlp.gate_up_proj, f"{path}.gate_up_proj", src, "gate_up")
    if b.buffers[gate_up].width != 2 * mlp.intermediate_size:
        raise UnsupportedModel(f"{path}: gate_up_proj is not [gate | up]")
    act = b.buffer("act", mlp.intermediate_size, IO)
    b.ops.append(act_op(gate_up, act))
    return b.linear(mlp.down_proj, f"{path}.down_proj", act, "down")


@lowering(GeluGatedMLP, "forward", "down", "_act")
def _lower_gelu_gated_mlp(mlp: GeluGatedMLP, b: ProgramBuilder, path: str, src: int) -> int:
    return _lower_gated_mlp(mlp, b, path, src, act_op=GeluTanhMul)


@lowering(Gemma3ForCausalLM, "forward")
def _lower_scaled_embedding_lm(model: Gemma3ForCausalLM, b: ProgramBuilder, path: str) -> int:
    """Scaled embeddings, and each layer's rope tables by its kind (local: sliding window)."""
    _single_rank(model, path)
    decoder = model.model
    b.dtype = decoder.norm.weight.dtype
    b.lower(model.local_rotary, "local_rotary")
    local = b.rope
    b.lower(model.rotary, "rotary")
    tables = {True: local, False: b.rope}
    h = b.buffer("h", model.config.hidden_size, ACT)
    b.ops.append(Scale(h, float(model.embed_scale)))
    b.embed = decoder.embed_tokens
    for i, layer in enumerate(decoder.layers):
        b.rope = tables[bool(layer.is_sliding)]
        b.lower(layer, f"model.layers.{i}", h)
    out = b.lower(decoder.norm, "model.norm", h, out="out", cls=ACT)
    b.io = (h, out)
    if type(model).compute_logits is DecoderForCausalLM.compute_logits:
        b.head = decoder.embed_tokens if model.lm_head is None else model.lm_head
    return out


@lowering(Gemma3DecoderLayer, "forward")
def _lower_sandwich_layer(layer: Gemma3DecoderLayer, b: ProgramBuilder, path: str,
                          h: int) -> int:
    """Norms before and after attention and MLP: each block's output normed (into the
    activations' dtype, as eager's norm returns it) before its residual add."""
    x = b.lower(layer.input_layernorm, f"{path}.input_layernorm", h)
    o = b.lower(layer.self_attn, f"{path}.self_attn", x)
    n = b.lower(layer.post_attention_layernorm, f"{path}.post_attention_layernorm", o,
                out="sandwich", cls=ACT)
    b.ops.append(Add(h, n))
    x = b.lower(layer.pre_feedforward_layernorm, f"{path}.pre_feedforward_layernorm", h)
    d = b.lower(layer.mlp, f"{path}.mlp", x)
    n = b.lower(layer.post_feedforward_layernorm, f"{path}.post_feedforward_layernorm", d,
                out="sandwich", cls=ACT)
    b.ops.append(Add(h, n))
    return h


def lower_model(model: nn.Module) -> ProgramBuilder:
    """``model``'s op program; UnsupportedModel naming the first block it cannot lower."""
    b = ProgramBuilder()
    b.lower(model, type(model).__name__)
    return b
