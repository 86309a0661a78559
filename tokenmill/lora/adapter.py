"""Reading a PEFT LoRA adapter folder and checking it against the base model.

A PEFT folder holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``, the targeted
modules...) and ``adapter_model.safetensors`` (or the older ``adapter_model.bin``) with an
``A`` (``[r, in]``) and a ``B`` (``[out, r]``) matrix per adapted projection. The update of a
projection is ``scale * B @ A @ x``, ``scale`` being ``alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA); it is folded into ``B`` here, so the layers multiply two matrices and nothing else.

Anything this engine would not compute exactly as PEFT does is refused with its name: DoRA,
trained biases, whole modules saved beside the adapter (``modules_to_save``), adapted
embeddings or LM heads.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file

from tokenmill.lora_request import LoRARequest
from tokenmill.models.config import ArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# The projections an adapter may target, by their Hugging Face names, in the order they sit in
# this engine's fused layers (q, k, v in qkv_proj; gate, up in gate_up_proj).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES

_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))"
                  r"\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted projection: ``a`` ``[r, in]`` and ``b`` ``[out, r]`` with the scale folded
    into ``b`` (fp32, on the CPU)."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: its request and its weights by ``(layer, module)``."""

    request: LoRARequest
    weights: dict[tuple[int, str], LoRAWeights]

    @property
    def rank(self) -> int:
        """The largest rank of its projections."""
        return max(w.rank for w in self.weights.values())

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def projection_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """``module -> (in_features, out_features)`` of each projection an adapter may target."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def read_adapter(request: LoRARequest, arch: ArchConfig, max_rank: int) -> LoRAAdapter:
    """The adapter of ``request`` checked against ``arch``; ValueError naming what is wrong
    (the folder, a config field, a tensor) when it cannot be served as PEFT would run it."""
    path = request.lora_path
    where = f"LoRA adapter {request.lora_name!r} ({path})"
    config = _read_config(path, where)
    tensors = _read_tensors(path, where)
    shapes = projection_shapes(arch)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in TARGET_MODULES:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A or B matrix of a "
                             f"projection this engine adapts ({', '.join(TARGET_MODULES)}); "
                             "adapted embeddings, LM heads, DoRA and LoRA biases are not "
                             "supported")
        layer = int(m.group(2))
        if layer >= arch.num_hidden_layers:
            raise ValueError(f"{where}: tensor {key!r} is for layer {layer}, but the model has "
                             f"{arch.num_hidden_layers} layers")
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = tensor
    if not pairs:
        raise ValueError(f"{where}: the weights hold no LoRA matrices")
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        name = f"model.layers.{layer}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}"
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise ValueError(f"{where}: {name} has no lora_{missing} matrix")
        a, b = ab["A"], ab["B"]
        in_features, out_features = shapes[module]
        rank = a.shape[0] if a.ndim == 2 else -1
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features or b.shape != (
                out_features, rank):
            raise ValueError(f"{where}: {name} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; this model needs ({rank}, {in_features}) and "
                             f"({out_features}, {rank}) (an adapter of another base model?)")
        if rank > max_rank:
            raise ValueError(f"{where}: {name} has rank {rank}, more than max_lora_rank "
                             f"{max_rank} (start the engine with --max-lora-rank {rank})")
        scale = _scale(config, name, rank)
        weights[(layer, module)] = LoRAWeights(a.float().contiguous(),
                                               (b.float() * scale).contiguous())
    return LoRAAdapter(request, weights)


def _read_config(path: str, where: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise ValueError(f"{where}: the path is not a directory")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{where}: no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} does not hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type is {peft_type!r}; only LORA adapters are served")
    refusals = {
        "use_dora": "DoRA adapters (use_dora) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (GPT-2 style Conv1D weights) is not supported",
        "lora_bias": "adapters with trained LoRA biases (lora_bias) are not supported",
        "modules_to_save": "the adapter saves whole modules beside its LoRA matrices "
                           "(modules_to_save), which are not served",
        "target_parameters": "adapters of parameters (target_parameters) are not supported",
        "trainable_token_indices": "adapters with trained token embeddings "
                                   "(trainable_token_indices) are not supported",
    }
    for field, why in refusals.items():
        if config.get(field):
            raise ValueError(f"{where}: {why} ({field}={config[field]!r})")
    if config.get("bias", "none") not in ("none", None):
        raise ValueError(f"{where}: adapters with trained biases are not supported "
                         f"(bias={config['bias']!r}; PEFT's default is 'none')")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{where}: {CONFIG_FILE} field {field!r} must be a positive "
                             f"number, got {value!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(field) or {}, dict):
            raise ValueError(f"{where}: {CONFIG_FILE} field {field!r} must be an object")
    return config


def _read_tensors(path: str, where: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            if name.endswith(".safetensors"):
                return load_file(file)
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's fault
            raise ValueError(f"{where}: {name} is not readable: {e}") from None
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            raise ValueError(f"{where}: {name} does not hold a dict of named tensors")
        return loaded
    raise ValueError(f"{where}: no {' or '.join(WEIGHT_FILES)}")


def _pattern_value(pattern: dict[str, Any], module_name: str) -> Any:
    """PEFT's lookup in ``rank_pattern``/``alpha_pattern``: the first key that matches the end
    of the module's name (``(.*\\.)?(key)$``), or None."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return None


def _scale(config: dict[str, Any], module_name: str, rank: int) -> float:
    """``alpha / r`` of one projection (``alpha / sqrt(r)`` with rsLoRA), ``alpha`` from
    ``alpha_pattern`` where a key matches the module, as PEFT computes it."""
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module_name)
    if alpha is None:
        alpha = config["lora_alpha"]
    if config.get("use_rslora"):
        return alpha / math.sqrt(rank)
    return alpha / rank
