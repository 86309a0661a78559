"""What a model is, read from its files' headers without loading a weight: the family, total
and active parameters, how each part is stored, and the KV cache's bytes per token
(`tokenmill info` and the start log's model line).

A GGUF file's tensor table gives each tensor's type and shape; a Hugging Face folder's
safetensors headers (the JSON before the data) give dtypes and shapes, and ``config.json``'s
``quantization_config`` names packed weights. A named preset (``--load-format dummy``) has no
file: its parameters are counted on the model built on the meta device.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenmill.model_loader.gguf import GGUFModel, load_gguf
from tokenmill.model_loader.hf import load_hf_config, safetensors_files
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class

# The parts a model is told in, in the order they are listed.
PARTS = ("embedding", "attention", "mlp", "experts", "head", "norms", "other")
# A quantized Hugging Face checkpoint's side tensors: scales, zero points, orders (no weights).
_AUX_SUFFIXES = ("_scales", ".scales", ".qzeros", ".g_idx", ".weight_scale", ".input_scale",
                 ".weight_scale_inv", ".weight_zero_point", ".zeros")
KV_BYTES_16BIT = 2


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor: its name, its storage type and how many weights it holds."""

    name: str
    kind: str
    numel: int


@dataclass(frozen=True)
class ModelSummary:
    """A model as its files describe it (see the module's note)."""

    path: str
    family: str
    model_type: str | None
    total_params: int
    active_params: int
    # (part, how it is stored), parts in PARTS order: "Q4_1", "BF16", "Q6_K 62%, Q4_K 38%".
    storage: tuple[tuple[str, str], ...]
    kv_layers: int
    kv_heads: int
    head_dim: int
    # Layers that attend over a sliding window (Gemma 3's local layers), and its tokens.
    sliding_layers: int = 0
    sliding_window: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer, at 16 bits a value."""
        return self.kv_layers * self.kv_heads * self.head_dim * 2 * KV_BYTES_16BIT

    def rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` lines for `tokenmill info`."""
        family = self.family + (f" ({self.model_type})" if self.model_type else "")
        return [("family", family), ("params total / active", self._params()),
                ("stored as", self._stored()), ("kv bytes per token", self._kv())]

    def one_line(self) -> str:
        """The summary as one log line."""
        return (f"model: {self.family}, {self._params()}; stored as {self._stored()}; KV per "
                f"token {self._kv()}")

    def _stored(self) -> str:
        kinds = {kind for part, kind in self.storage if kind != "tied to the embedding"}
        if len(kinds) == 1 and all(", " not in k for k in kinds):
            return f"{kinds.pop()} (every part)"
        return "; ".join(f"{part} {kind}" for part, kind in self.storage)

    def _params(self) -> str:
        if self.active_params == self.total_params:
            return f"{_count(self.total_params)} (dense: all active)"
        return f"{_count(self.total_params)} / {_count(self.active_params)} active per token"

    def _kv(self) -> str:
        if not self.kv_layers:
            return "none (an encoder keeps no KV cache)"
        line = (f"{self.kv_bytes_per_token:,} B at 16 bits ({self.kv_layers} layers x "
                f"{self.kv_heads} KV heads x {self.head_dim} dims x K and V; fp32: twice, fp8: "
                "half)")
        if self.sliding_layers and self.sliding_window:
            full = self.kv_layers - self.sliding_layers
            past = self.kv_bytes_per_token * full // self.kv_layers
            line += (f"; {self.sliding_layers} layers slide over {self.sliding_window} tokens, "
                     f"so past that a token adds {past:,}")
        return line


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def summarize(path: str) -> ModelSummary:
    """The summary of a GGUF file, a Hugging Face folder or a preset's name; ValueError for
    anything else, or an architecture tokenmill does not run (naming those it runs)."""
    if os.path.isfile(path):
        return summarize_gguf(load_gguf(path))
    if os.path.isdir(path):
        return summarize_hf(path)
    from tokenmill.presets import PRESETS

    if path in PRESETS:
        return summarize_preset(path)
    raise ValueError(f"model {path!r} is neither a .gguf file, a Hugging Face folder nor a "
                     "preset")


def summarize_gguf(model: GGUFModel) -> ModelSummary:
    """A GGUF file's summary, from its header (each tensor's GGML type and shape)."""
    entries = [TensorEntry(t.name, t.tensor_type.name, math.prod(t.shape))
               for t in model.stored_tensors()]
    return _summary(model.path, model.hf_config, entries)


def summarize_hf(path: str) -> ModelSummary:
    """A Hugging Face folder's summary, from config.json and its safetensors headers."""
    config = load_hf_config(path)
    quant = config.get("quantization_config") or {}
    entries = [e for file in safetensors_files(path)
               for name, info in read_safetensors_header(file).items()
               if (e := _hf_entry(name, info["dtype"], info["shape"], quant)) is not None]
    return _summary(path, config, entries)


def summarize_preset(name: str) -> ModelSummary:
    """A preset's summary: its parameters counted on the model built on the meta device."""
    import torch

    from tokenmill.presets import get_preset

    config = get_preset(name)
    arch = _arch(config)
    with torch.device("meta"):
        model = get_model_class([arch.architecture])(arch)
    entries = [TensorEntry(n, "random (dummy)", p.numel()) for n, p in model.named_parameters()]
    return _summary(name, config, entries)


def read_safetensors_header(file: str) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensor table (name -> dtype, shape, offsets), read from its header
    alone: 8 bytes of length, then that much JSON."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file!r} is not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{file!r} is not a safetensors file (its header is no JSON)") \
                from None
    header.pop("__metadata__", None)
    return header


def _hf_entry(name: str, dtype: str, shape: list[int], quant: dict[str, Any]
              ) -> TensorEntry | None:
    """A safetensors tensor as weights: None for a quantized checkpoint's side tensors; packed
    4-bit tensors counted by the values they hold (two a byte; 32 / bits an int32)."""
    if quant and name.endswith(_AUX_SUFFIXES):
        return None
    numel = math.prod(shape)
    method = str(quant.get("quant_method", "quantized"))
    if name.endswith("_blocks"):  # MXFP4 (gpt-oss): two values a byte
        return TensorEntry(name, method, numel * 2)
    if name.endswith(".qweight"):  # GPTQ / AWQ: 32 / bits values an int32
        bits = int(quant.get("bits", 4))
        return TensorEntry(name, f"{method} int{bits}", numel * 32 // bits)
    if quant and dtype.startswith("F8"):
        return TensorEntry(name, f"{method} {dtype}", numel)
    return TensorEntry(name, dtype, numel)


def part_of(name: str) -> str:
    """Which part a tensor belongs to, by its Hugging Face or GGUF name."""
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if "embed_tokens" in name or name.startswith("token_embd"):
        return "embedding"
    if name.startswith(("lm_head", "output.")):
        return "head"
    if "norm" in leaf:
        return "norms"
    if "experts" in name or "_exps" in name:
        return "experts"
    if "attn" in name:
        return "attention"
    if "mlp" in name or "ffn" in name or "feed_forward" in name or "moe" in name:
        return "mlp"
    return "other"


def _storage(entries: Iterable[TensorEntry], tied: bool) -> tuple[tuple[str, str], ...]:
    by_part: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in entries:
        by_part[part_of(e.name)][e.kind] += e.numel
    if tied and "head" not in by_part:
        by_part["head"] = {}
    out = []
    for part in PARTS:
        kinds = by_part.get(part)
        if kinds is None:
            continue
        total = sum(kinds.values())
        if not kinds:
            out.append((part, "tied to the embedding"))
        elif len(kinds) == 1:
            out.append((part, next(iter(kinds))))
        else:
            shares = sorted(kinds.items(), key=lambda kv: -kv[1])
            out.append((part, ", ".join(f"{k} {100 * n / total:.0f}%" for k, n in shares)))
    return tuple(out)


def _arch(config: dict[str, Any]) -> ArchConfig:
    if config.get("architectures"):
        get_model_class(config["architectures"])  # unsupported: names the supported ones
    return ArchConfig.from_hf_dict(config)


def _summary(path: str, config: dict[str, Any], entries: list[TensorEntry]) -> ModelSummary:
    arch = _arch(config)
    total = sum(e.numel for e in entries)
    experts = sum(e.numel for e in entries if part_of(e.name) == "experts")
    # Mixture of experts: a token runs top-k of the E experts (read with getattr: the MoE
    # fields belong to the families that have them).
    num_experts = getattr(arch, "num_experts", 0) or 0
    top_k = getattr(arch, "num_experts_per_tok", 0) or 0
    active = total
    if num_experts and top_k and experts:
        active = total - experts * (num_experts - top_k) // num_experts
    layer_types = getattr(arch, "layer_types", ()) or ()
    return ModelSummary(
        path=path, family=arch.architecture, model_type=config.get("model_type"),
        total_params=total, active_params=active,
        storage=_storage(entries, arch.tie_word_embeddings),
        kv_layers=0 if arch.is_encoder else arch.num_hidden_layers,
        kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim, sliding_layers=sum(t == "sliding_attention" for t in layer_types),
        sliding_window=getattr(arch, "sliding_window", None))
