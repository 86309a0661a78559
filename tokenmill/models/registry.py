"""Hugging Face ``architectures`` names -> model classes, imported only when asked for, and
the one way to build an empty model of a class in the target dtype."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from tokenmill.models.config import ArchConfig

# architecture name -> (module, class); lazy so that importing the registry stays cheap.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.models.qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("tokenmill.models.phi3", "Phi3ForCausalLM"),  # Phi-3, Phi-4
    # Mixture of experts (models/moe.py).
    "Qwen3MoeForCausalLM": ("tokenmill.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("tokenmill.models.mixtral", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("tokenmill.models.gpt_oss", "GptOssForCausalLM"),  # gpt-oss
    "Gemma3ForCausalLM": ("tokenmill.models.gemma3", "Gemma3ForCausalLM"),
    # Encoders for embeddings; a BertFor* checkpoint's task head is left unused.
    "BertModel": ("tokenmill.models.bert", "BertModel"),
    "BertForMaskedLM": ("tokenmill.models.bert", "BertModel"),
    "BertForPreTraining": ("tokenmill.models.bert", "BertModel"),
    # A cross-encoder (reranker): its one-label head scores a pair.
    "BertForSequenceClassification": ("tokenmill.models.bert", "BertForSequenceClassification"),
}


def supported_architectures() -> list[str]:
    """The ``architectures`` names that :func:`get_model_class` accepts."""
    return sorted(_MODELS)


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class for the first supported name in ``architectures`` (a config.json list)."""
    for arch in architectures:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(f"unsupported architectures {architectures}; supported: "
                     f"{', '.join(supported_architectures())}")


def create_model(arch: ArchConfig, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The model class for ``arch`` built on ``device`` with its parameters created in
    ``dtype`` (no fp32 detour, no host copy); their values are whatever the constructor left."""
    model_cls = get_model_class([arch.architecture])
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(arch)
    finally:
        torch.set_default_dtype(default_dtype)
    from tokenmill.models.kernel_binding import bind_kernels

    bind_kernels(model, device)  # each block's kernels, chosen once for the device
    return model
