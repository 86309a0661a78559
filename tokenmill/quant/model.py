"""``quantize_model``: swap a loaded model's Linear layers (and head) for weight-only ones."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.config import QUANTIZATIONS
from tokenmill.models.layers import DecoderLayer, GatedMLP, RotaryEmbedding
from tokenmill.quant import kernel_choice
from tokenmill.quant.experts import quantize_experts
from tokenmill.quant.fp8 import Fp8Linear, fp8_supported, fp8_unsupported_reason
from tokenmill.quant.head import QuantizedEmbedding, QuantizedHead, QuantizedLinear
from tokenmill.quant.kernel_choice import NEVER_DENSE
from tokenmill.quant.linear import (
    Int4TinyGemmLinear,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    _WeightOnlyLinear,
)
from tokenmill.quant.packing import (
    INT4_GROUP_SIZES,
    check_int4_shape,
    int4_layout_known,
)
from tokenmill.utils import release_freed_memory

logger = logging.getLogger(__name__)

QUANT_METHODS = tuple(q for q in QUANTIZATIONS if q != "auto")  # none, int8, int4, fp8
# What quantization="auto" resolves to for a GGUF file on the CPU: every Linear layer keeps its
# tensors' own GGUF block types (KQuantLinear, built by the GGUF loader), none is requantized;
# the output head follows DEFAULT_HEAD_METHOD as under int8 / int4.
KEEP_GGUF_TYPES = "gguf"
DEFAULT_GROUP_SIZE = 32
# The output head (or tied embedding) under every method: on SmolLM2-135M an int4 head costs
# +9.7% perplexity, an int8 one +0.2%, for 11 MiB (benchmarks/results/perplexity-cpu.md); GGUF
# files keep it at 6-8 bits for the same reason.
DEFAULT_HEAD_METHOD = "int8"
# Every module quantize_model may put in place of a Linear layer.
QUANTIZED_MODULES = (_WeightOnlyLinear, Fp8Linear)


@dataclass
class QuantizationSummary:
    """What :func:`quantize_model` did, for the load log."""

    method: str
    group_size: int | None
    # Linear layers now quantized (including any quantized before this call) and the names
    # of those left in float, with the reason.
    num_quantized: int = 0
    kept_float: dict[str, str] = field(default_factory=dict)
    head: str = "float"
    weight_bytes: int = 0

    def describe(self) -> str:
        group = f" (group size {self.group_size})" if self.method == "int4" else ""
        kept = f", {len(self.kept_float)} kept in float" if self.kept_float else ""
        return (f"quantization {self.method}{group}: {self.num_quantized} linear layers{kept}, "
                f"head {self.head}; weights {self.weight_bytes / 2**20:.0f} MiB")


def check_quantization(method: str, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    """ValueError naming the field unless ``method`` / ``group_size`` are supported."""
    if method not in QUANT_METHODS and method != KEEP_GGUF_TYPES:
        raise ValueError(f"quantization must be one of {QUANT_METHODS}, got {method!r}")
    if method == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")


def quantize_weight(weight: torch.Tensor, bias: torch.Tensor | None, method: str,
                    group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedLinear:
    """A quantized module for a float ``[out, in]`` weight on its device; ValueError if the shape
    does not suit the kernel (int4: ``in`` a multiple of the group size, ``out`` of 16; fp8:
    both multiples of 16)."""
    check_quantization(method, group_size)
    if method == "int8":
        return Int8WeightOnlyLinear.from_weight(weight, bias)
    if method == "int4" and weight.device.type == "cuda":
        return Int4TinyGemmLinear.from_weight(weight, bias, group_size)
    if method == "int4":
        return Int4WeightOnlyLinear.from_weight(weight, bias, group_size)
    if method == "fp8":
        return Fp8Linear.from_weight(weight, bias)
    raise ValueError(f"quantization {method!r} builds no quantized module")


def count_parameters(model: nn.Module) -> int:
    """Weights the model computes with, quantized ones counted as the float matrix they stand
    for (``numel`` of a packed int4 buffer would count two weights as one)."""
    counted: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, QUANTIZED_MODULES):
            total += module.in_features * module.out_features
            tensors = [module.bias] if module.bias is not None else []
        else:
            tensors = list(module.parameters(recurse=False))
        for t in tensors:
            if id(t) not in counted:
                counted.add(id(t))
                total += t.numel()
    return total


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (each tensor counted once)."""
    return _tensor_bytes(model, skip=set())


def decode_read_bytes(model: nn.Module) -> int:
    """Bytes of the model's tensors that one decode step reads, each once: what
    :func:`model_weight_bytes` counts but the tables a step reads one row of, the rotary
    embedding's positions and, where the model has an output head of its own, the token
    embedding (a tied one is the head's weight: read whole). The memory roofline's bytes per
    token, counted as ``tokenmill/bench/roofline.py`` counts a GGUF file's."""
    untied = getattr(model, "lm_head", None) is not None
    lookups: set[int] = set()
    read: set[int] = set()
    for module in model.modules():
        own = {id(t) for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]}
        if isinstance(module, RotaryEmbedding) or (untied and isinstance(module, nn.Embedding)):
            lookups |= own
        else:
            read |= own
    return _tensor_bytes(model, skip=lookups - read)


def _tensor_bytes(model: nn.Module, skip: set[int]) -> int:
    seen = set(skip)
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def resolve_head_method(method: str, head_method: str | None,
                        device: torch.device | None = None) -> str:
    """The head's method: ``head_method`` if given, else int8 on the CPU whenever ``method`` is
    not none. On GPUs the head stays in float, as vLLM and TensorRT-LLM keep it: it is a small
    share of a large model's weights and the most sensitive one."""
    if head_method is None:
        if method == "none" or (device is not None and device.type != "cpu"):
            return "none"
        return DEFAULT_HEAD_METHOD
    if head_method not in QUANT_METHODS:
        raise ValueError(f"head_method must be one of {QUANT_METHODS}, got {head_method!r}")
    return head_method


def quantize_model(model: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                   *, head_method: str | None = None) -> QuantizationSummary:
    """Replace the model's ``nn.Linear`` layers (fused qkv / gate_up included) in place with
    weight-only int8 (per output channel) or int4 (``group_size`` columns per group) ones, or
    fp8 ones (per output channel, activations per token).

    The output head gets ``head_method`` (default on the CPU: int8, see DEFAULT_HEAD_METHOD; on
    GPUs: float); a tied embedding is then stored once, quantized, for both the lookup and the
    head. Layers quantized earlier (e.g. straight from a GGUF file) are kept; layers the kernel
    cannot take stay float (listed in the summary).
    """
    check_quantization(method, group_size)
    param = next(model.parameters(), None)
    device = param.device if param is not None else None
    head_method = resolve_head_method(method, head_method, device)
    if "fp8" in (method, head_method) and device is not None and not fp8_supported(device):
        raise ValueError(f"quantization 'fp8' on {device}: {fp8_unsupported_reason(device)}")
    summary = QuantizationSummary(method, group_size if method == "int4" else None)
    if method != "none" or head_method != "none":
        if method not in ("none", KEEP_GGUF_TYPES):
            _quantize_linears(model, method, group_size, summary)
            fuse_fp8_inputs(model)
        _quantize_head(model, head_method, group_size, summary)
        release_freed_memory()
    summary.head = describe_head(model)
    summary.num_quantized = sum(isinstance(m, QUANTIZED_MODULES)
                                for name, m in model.named_modules()
                                if not name.endswith(("lm_head.linear", "embed_tokens.table")))
    summary.weight_bytes = model_weight_bytes(model)
    return summary


def linear_layer_names(model: nn.Module) -> list[str]:
    """The float Linear layers that the weight-only methods replace: all but the output head
    (which has its own method, see :func:`head_slot`).

    Names, not modules: each float layer is freed as soon as it is replaced, so memory never
    holds both whole models.
    """
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name != "lm_head"]


def _quantize_linears(model: nn.Module, method: str, group_size: int,
                      summary: QuantizationSummary) -> None:
    for name in linear_layer_names(model):
        linear = model.get_submodule(name)
        try:
            quantized = quantize_weight(linear.weight, linear.bias, method, group_size)
        except ValueError as e:
            summary.kept_float[name] = str(e)
            logger.warning("%s stays in float: %s", name, e)
            continue
        replace_module(model, name, quantized)
    # A mixture of experts' stacked weights (models/moe.py), quantized per expert.
    quantize_experts(model, lambda w: quantize_weight(w, None, method, group_size),
                     summary.kept_float)


def fuse_fp8_inputs(model: nn.Module) -> int:
    """Have the kernels whose output an ``Fp8Linear`` reads (a layer's two norms, its
    SiLU-and-mul) quantize that output themselves on CUDA, with the bytes the linear would
    make of it: one kernel fewer per linear. o_proj's input comes from the attention backend
    and is still quantized by the linear. Returns how many kernels now do."""
    fused = 0
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and isinstance(layer.mlp, GatedMLP):
            attn, mlp = layer.self_attn, layer.mlp
            layer.input_layernorm.fp8_out = isinstance(attn.qkv_proj, Fp8Linear)
            layer.post_attention_layernorm.fp8_out = isinstance(mlp.gate_up_proj, Fp8Linear)
            mlp.fp8_act = isinstance(mlp.down_proj, Fp8Linear)
            fused += (layer.input_layernorm.fp8_out + layer.post_attention_layernorm.fp8_out
                      + mlp.fp8_act)
    return fused


def head_slot(model: nn.Module) -> tuple[str, bool] | None:
    """Where the output head's float weight lives: ``("lm_head", False)`` for an untied head,
    ``("model.embed_tokens", True)`` for a tied embedding table; None if quantized or absent."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        return "lm_head", False
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None and isinstance(embed, nn.Embedding):
        return "model.embed_tokens", True
    return None


def head_unsupported(shape: torch.Size | tuple[int, ...], method: str, group_size: int,
                     tied: bool) -> str | None:
    """Why a head of this shape must stay float, or None if it can be quantized."""
    if method != "int4":
        return None
    if tied and not int4_layout_known():
        return "int4 row lookups need the known packed layout"
    try:
        check_int4_shape(shape[0], shape[1], group_size)
    except ValueError as e:
        return str(e)
    return None


def wrap_head(linear: QuantizedLinear, tied: bool, dtype: torch.dtype) -> nn.Module:
    """The module that replaces the head (or, tied, the embedding table) around ``linear``.

    On the CPU the head computes fp32 logits from fp32 hidden states (``fp32_io``): bf16
    logits are 0.125 apart around 20, coarse enough to tie a greedy choice. An int8 head also
    computes batches of rows on its weight in output tiles (``row_tiles``)."""
    linear.fp32_io = dtype == torch.float32
    if isinstance(linear, Int8WeightOnlyLinear):
        linear.row_tiles = True
    return QuantizedEmbedding(linear, dtype) if tied else QuantizedHead(linear, dtype)


def _quantize_head(model: nn.Module, method: str, group_size: int,
                   summary: QuantizationSummary) -> None:
    """Quantize a float ``lm_head``, or the tied embedding table, with ``method``."""
    slot = head_slot(model)
    if slot is None or method == "none":
        return
    name, tied = slot
    float_module = model.get_submodule(name)
    reason = head_unsupported(float_module.weight.shape, method, group_size, tied)
    if reason is not None:
        summary.kept_float[name] = reason
        return
    linear = quantize_weight(float_module.weight, getattr(float_module, "bias", None), method,
                             group_size)
    replace_module(model, name, wrap_head(linear, tied, float_module.weight.dtype))


def describe_head(model: nn.Module) -> str:
    """How the output head is stored: "float", "int8" or "int4", and whether it is tied."""
    head = getattr(model, "lm_head", None)
    module = head if head is not None else getattr(getattr(model, "model", None),
                                                   "embed_tokens", None)
    inner = getattr(module, "linear", None) or getattr(module, "table", None)
    kind = {Int8WeightOnlyLinear: "int8", Int4WeightOnlyLinear: "int4",
            Int4TinyGemmLinear: "int4", Fp8Linear: "fp8"}.get(type(inner), "float")
    return kind + (" (tied embedding)" if head is None else "")


def pin_row_kernels(model: nn.Module) -> int:
    """Send every row count of every weight-only layer of ``model`` (head included) to its int
    kernel, never to the dense matmul; returns how many layers that changed.

    The int kernels compute each output as one FMA chain over the inputs in a fixed order, and
    every tile of rows runs the same code, so a row's result does not depend on how many rows
    share the call; switching to the dense path at a row count rounds differently. The
    deterministic engine needs that invariance (``EngineConfig.deterministic``); prefill pays
    for it, as the kernels are slower than the dense path from ~100 rows on.
    """
    changed = 0
    prompt_bits = kernel_choice.setting("INT4_ACT_BITS")
    for module in model.modules():
        if not isinstance(module, _WeightOnlyLinear):
            continue
        int4 = isinstance(module, Int4WeightOnlyLinear)
        if (module.dense_min_rows != NEVER_DENSE or module.own_min_rows != 1
                or (int4 and module.decode_act_bits != prompt_bits)):
            module.dense_min_rows = NEVER_DENSE
            module.own_min_rows = 1  # and one int kernel at every row count,
            if int4:
                module.decode_act_bits = prompt_bits  # on the same activations in every step
            changed += 1
    return changed


def float_matmul_layers(model: nn.Module) -> list[str]:
    """Names of the layers that multiply with a float weight: Linear layers left unquantized,
    and a float output head or tied embedding table (used as the head)."""
    slot = head_slot(model)
    return linear_layer_names(model) + ([slot[0]] if slot is not None else [])


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in place of the submodule called ``name``. Where that is the output head
    (or the tied embedding table), the model chooses its logits' product again
    (``bind_head``): the choice is made when the head changes, not at every call."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)
    bind_head = getattr(model, "bind_head", None)
    if bind_head is not None and name in ("lm_head", "model.embed_tokens"):
        bind_head()
