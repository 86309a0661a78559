"""Load a GGUF file into quantized layers straight from its blocks.

Q4_1 stores 32 weights as ``d * q + m`` (fp16 ``d`` and ``m``, 4-bit ``q``) and Q4_0 as
``d * (q - 8)``: both are exactly :class:`~tokenmill.quant.packing.Int4Groups` with group size
32, so under ``--quantization int4`` those tensors keep the file's own nibbles and groups
instead of being dequantized and quantized a second time. (The int4 kernel takes its scale
and zero in bf16, so ``d`` and ``m + 8 d`` are rounded to bf16 there, 2^-9 relative each:
for a zero-centred group about d/64 per weight, against the format's own rounding of d/2.)
Every other case is requantized from the
dequantized fp32 values, one tensor at a time: Q8_0 (a scale per 32 weights) to int8 (a scale
per row) rounds again; so does anything to int4 with a group size other than 32.

:func:`load_gguf_quantized` builds the model's Linear layers this way *before* the rest is
loaded, so the float copies of those layers are never filled in memory; tensors that are
requantized are dequantized a few thousand rows at a time for the same reason.

Under ``quantization="auto"`` (``KEEP_GGUF_TYPES``) nothing is requantized: each Linear layer
keeps its tensors' blocks as the file stores them, in their own types (a Q4_K_M file keeps its
Q4_K, Q6_K, Q5_0... tensors), in a :class:`~tokenmill.quant.kquant.KQuantLinear`; a tensor
whose type has no kernel is refused by name, never widened to floats behind the user's back.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from torch import nn

from tokenmill.model_loader.gguf import GGUFModel, RawTensor, float_from_gguf, float_tensor
from tokenmill.models.decoder import STACKED_PARAMS
from tokenmill.quant.head import QuantizedLinear
from tokenmill.quant.kquant import KQuantLinear, check_kquant_type
from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from tokenmill.quant.model import (
    DEFAULT_GROUP_SIZE,
    KEEP_GGUF_TYPES,
    check_quantization,
    head_slot,
    head_unsupported,
    linear_layer_names,
    replace_module,
    resolve_head_method,
    wrap_head,
)
from tokenmill.quant.packing import (
    QUANTIZE_ROWS,
    Int4Groups,
    check_int4_shape,
    quantize_int4,
    quantize_int8,
)
from tokenmill.utils import release_freed_memory

logger = logging.getLogger(__name__)
# (weights, bytes) per block, by ggml type id.
_BLOCK_SIZES = {int(t): size for t, size in GGML_QUANT_SIZES.items()}

GGUF_GROUP = 32
# Tensors stored in these types are loaded in float whatever the method (a float layer stays
# float under KEEP_GGUF_TYPES: nothing to keep compact).
_FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                          GGMLQuantizationType.BF16, GGMLQuantizationType.F64})
# Hand the freed temporaries back to the OS after this many quantized layers.
TRIM_EVERY_LAYERS = 16
# Bytes per block of 32 weights: (d fp16, [m fp16], 16 bytes of nibbles).
_Q4_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}


def int4_groups_from_gguf(raw: RawTensor) -> Int4Groups:
    """The 4-bit values, scales and mins of a Q4_0 / Q4_1 tensor, without rounding anything:
    ``Int4Groups.dequantize()`` equals gguf's dequantization bit for bit."""
    if raw.qtype not in _Q4_BLOCK_BYTES or len(raw.shape) != 2:
        raise ValueError(f"{raw.name}: expected a 2-D Q4_0 or Q4_1 tensor, got "
                         f"{raw.qtype.name} {raw.shape}")
    n, k = raw.shape
    blocks = np.ascontiguousarray(raw.data).reshape(n, k // GGUF_GROUP, _Q4_BLOCK_BYTES[raw.qtype])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if raw.qtype == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]
    else:  # d * (q - 8) = d * q + (-8 d), exactly: both products are exact in fp32
        m = -8.0 * d
        packed = blocks[..., 2:]
    # Byte j of a block holds weight j in its low nibble and weight j + 16 in its high one.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k)
    return Int4Groups(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), GGUF_GROUP)


def _float_rows(raw: RawTensor) -> Iterator[torch.Tensor]:
    """The fp32 values of a 2-D tensor, ``QUANTIZE_ROWS`` rows at a time (bounded memory)."""
    for r0 in range(0, raw.shape[0], QUANTIZE_ROWS):
        rows = raw.data[r0:r0 + QUANTIZE_ROWS]
        yield float_tensor(rows, raw.qtype, (rows.shape[0], raw.shape[1]))
        if raw.shape[0] > QUANTIZE_ROWS:
            release_freed_memory()  # the previous rows' temporaries (a tied embedding's: 100s of MB)


def _part_names(module_name: str) -> list[str]:
    """HF tensor prefixes whose rows make up ``module_name`` (fused layers have several)."""
    parent, _, leaf = module_name.rpartition(".")
    parts = sorted((shard, hf) for fused, hf, shard in STACKED_PARAMS if fused == leaf)
    return [f"{parent}.{hf}" for _, hf in parts] if parts else [module_name]


def _int4_part(raw: RawTensor, group_size: int) -> Int4Groups:
    if raw.qtype in _Q4_BLOCK_BYTES and group_size == GGUF_GROUP:
        return int4_groups_from_gguf(raw)
    return Int4Groups.cat([quantize_int4(rows, group_size) for rows in _float_rows(raw)])


def _bias(gguf: GGUFModel, module_name: str, dtype: torch.dtype) -> torch.Tensor | None:
    names = [f"{p}.bias" for p in _part_names(module_name)]
    present = [n in gguf.tensor_names() for n in names]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"{module_name}: only some of {names} are in the file")
    return torch.cat([float_from_gguf(gguf.raw_tensor(n)) for n in names]).to(dtype)


def quantized_linear_from_gguf(gguf: GGUFModel, module_name: str, method: str,
                               group_size: int = DEFAULT_GROUP_SIZE,
                               dtype: torch.dtype = torch.float32) -> QuantizedLinear:
    """The quantized module for ``module_name`` (an HF-style path such as
    ``model.layers.0.self_attn.qkv_proj``, ``lm_head`` or ``model.embed_tokens``) from the
    file's tensors; ValueError if a tensor is missing or the kernel cannot take the shape."""
    check_quantization(method, group_size)
    raws = [gguf.raw_tensor(f"{p}.weight") for p in _part_names(module_name)]
    bias = _bias(gguf, module_name, dtype)
    if method == "int8":
        pieces = [quantize_int8(rows) for raw in raws for rows in _float_rows(raw)]
        return Int8WeightOnlyLinear(torch.cat([q for q, _ in pieces]),
                                    torch.cat([s for _, s in pieces]), bias)
    check_int4_shape(sum(r.shape[0] for r in raws), raws[0].shape[1], group_size)
    return Int4WeightOnlyLinear.from_groups(
        Int4Groups.cat([_int4_part(r, group_size) for r in raws]), bias)


def kquant_linear_from_gguf(gguf: GGUFModel, module_name: str,
                            dtype: torch.dtype = torch.float32) -> KQuantLinear | None:
    """``module_name``'s layer on its tensors' blocks as stored, each part in its own type;
    None where its tensors are float (the layer stays a float Linear). ValueError naming the
    tensor, its type and the supported types where a type has no kernel."""
    raws = [gguf.raw_tensor(f"{p}.weight") for p in _part_names(module_name)]
    floats = [r.qtype in _FLOAT_TYPES for r in raws]
    if all(floats):
        return None
    for raw in raws:
        if raw.qtype not in _FLOAT_TYPES:
            try:
                check_kquant_type(raw.qtype, raw.name)
            except ValueError as e:
                raise ValueError(f"{e} (quantization 'none' loads it in float, at 4 bytes a "
                                 "weight; 'int8' / 'int4' requantize it)") from e
    if any(floats):  # a fused layer of float and quantized parts: no kernel takes both
        logger.warning("%s mixes float and quantized tensors: loaded in float", module_name)
        return None
    parts = [(torch.from_numpy(np.array(raw.data, dtype=np.uint8, copy=True)), raw.qtype)
             for raw in raws]
    return KQuantLinear(parts, raws[0].shape[1], _bias(gguf, module_name, dtype))


def _load_kept_types(model: nn.Module, gguf: GGUFModel, device: torch.device | None,
                     dtype: torch.dtype) -> tuple[list[str], set[str]]:
    """KEEP_GGUF_TYPES: every Linear layer on its file blocks; (built names, tensors used)."""
    built: list[str] = []
    consumed: set[str] = set()
    kept: Counter[str] = Counter()
    kept_bytes: Counter[str] = Counter()
    for name in linear_layer_names(model):
        module = kquant_linear_from_gguf(gguf, name, dtype)
        if module is None:
            continue
        _install(model, name, module, device)
        built.append(name)
        consumed.update(f"{p}.{kind}" for p in _part_names(name) for kind in ("weight", "bias"))
        for (qtype, rows) in module.segments.tolist():
            type_name = GGMLQuantizationType(qtype).name
            kept[type_name] += 1
            kept_bytes[type_name] += rows * module.in_features // _BLOCK_SIZES[qtype][0] \
                * _BLOCK_SIZES[qtype][1]
    logger.info("GGUF types kept: %s", ", ".join(
        f"{t} {kept[t]} tensors {kept_bytes[t] / 2**20:.1f} MiB" for t in sorted(kept)) or "none")
    return built, consumed


def load_gguf_quantized(model: nn.Module, gguf: GGUFModel, method: str,
                        group_size: int = DEFAULT_GROUP_SIZE,
                        device: torch.device | None = None,
                        dtype: torch.dtype = torch.float32,
                        head_method: str | None = None) -> list[str]:
    """Fill a freshly built model from ``gguf``: its Linear layers (``method``) and output head
    or tied embedding (``head_method``, as in ``quantize_model``) quantized from the file's
    tensors, everything else through ``model.load_weights``.

    Returns the names of the modules built here. Those the kernel cannot take are loaded in
    float as usual, for ``quantize_model`` to log and leave alone.
    """
    check_quantization(method, group_size)
    head_method = resolve_head_method(method, head_method)
    if getattr(model, "tp_size", 1) > 1:
        raise ValueError("load_gguf_quantized builds whole layers, not tensor-parallel shards; "
                         "load the shards in float and quantize_model them (as load_model does)")
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"quantization {method!r} runs on the CPU only, not on {device}")
    built: list[str] = []
    consumed: set[str] = set()
    if method == KEEP_GGUF_TYPES:
        built, consumed = _load_kept_types(model, gguf, device, dtype)
    for name in linear_layer_names(model) if method != KEEP_GGUF_TYPES else []:
        try:
            module: nn.Module = quantized_linear_from_gguf(gguf, name, method, group_size, dtype)
        except ValueError:
            continue
        _install(model, name, module, device)
        built.append(name)
        consumed.update(f"{p}.{kind}" for p in _part_names(name) for kind in ("weight", "bias"))
        if len(built) % TRIM_EVERY_LAYERS == 0:
            # The layers' temporaries stay in glibc's heap unless trimmed: untrimmed, loading
            # the 135M model peaked at 830 MB for 370 MB of live memory (a trim costs ~5 ms).
            release_freed_memory()
    slot = head_slot(model)
    if slot is not None and head_method != "none":
        name, tied = slot
        raw_shape = gguf.raw_tensor(f"{name}.weight").shape
        if head_unsupported(raw_shape, head_method, group_size, tied) is None:
            linear = quantized_linear_from_gguf(gguf, name, head_method, group_size, dtype)
            _install(model, name, wrap_head(linear, tied, dtype), device)
            built.append(name)
            consumed.add(f"{name}.weight")
            release_freed_memory()
    model.load_weights(_float_tensors(gguf, consumed, device, dtype))
    release_freed_memory()
    return built


def _install(model: nn.Module, name: str, module: nn.Module, device: torch.device | None) -> None:
    replace_module(model, name, module.to(device) if device is not None else module)


def _float_tensors(gguf: GGUFModel, skip: set[str], device: torch.device | None,
                   dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for name in gguf.tensor_names():
        if name not in skip:
            yield name, float_from_gguf(gguf.raw_tensor(name)).to(device=device, dtype=dtype)
