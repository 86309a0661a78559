"""Rope variants of the Phi-3 / Phi-4 family: longrope's per-frequency factors and its
attention factor, and partial rotary (only the first ``rotary_dim`` dims of a head turn) made
into the full-width rotate-half rope every kernel already computes.

Partial rotary without a kernel of its own: rotate-half pairs dim ``i`` with ``i + D/2``,
Hugging Face's partial rope pairs ``i`` with ``i + R/2`` inside the first ``R`` dims and leaves
the rest. Reordering the rows of q and k within each head (the same order for both, so every
q.k product is unchanged) puts HF's pair ``(i, i + R/2)`` at ``(i, i + D/2)``; the pairs past
``R/2`` get frequency 0 (cos 1, sin 0) and pass through. V and the output are untouched.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from tokenmill.models.config import ArchConfig


def longrope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any],
                      max_positions: int) -> torch.Tensor:
    """Longrope's ``[rotary_dim // 2]`` frequencies: the base ones divided by the long factors
    when the context served (the engine's ``max_model_len`` where :func:`serve_context` put it
    in ``scaling``, else the model's ``max_positions``) is longer than the pretraining one,
    else by the short factors.

    Transformers switches per forward call (long once a sequence passes the pretraining
    length, also for the positions already in the cache); one choice for the whole context,
    as llama.cpp and vLLM make it, keeps every cached key valid for prefix caching, chunked
    prefill and preemption. It equals transformers wherever the context or the prompt is past
    the pretraining length, and for a context within it.
    """
    original = int(scaling["original_max_position_embeddings"])
    context = int(scaling.get("served_context") or max_positions)
    key = "long_factor" if context > original else "short_factor"
    factors = torch.tensor(scaling[key], dtype=torch.float32)
    if factors.numel() != rotary_dim // 2:
        raise ValueError(f"rope_scaling.{key} has {factors.numel()} factors, expected "
                         f"{rotary_dim // 2} (half the rotated dims)")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (factors * theta ** exponents)


def serve_context(arch: ArchConfig, max_model_len: int | None) -> ArchConfig:
    """``arch`` with the engine's context in a longrope model's ``rope_scaling`` (its factors
    follow it); any other model, or no max_model_len, unchanged."""
    scaling = arch.rope_scaling
    if max_model_len is None or scaling is None or scaling.get("rope_type") != "longrope":
        return arch
    return dataclasses.replace(arch, rope_scaling={**scaling, "served_context": max_model_len})


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor longrope scales cos and sin by (so q.k by its square): the config's
    ``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original context))``; 1 otherwise."""
    if scaling is None or scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(int(scaling["original_max_position_embeddings"])))


def partial_rotary_row_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """For each of a head's dims in our layout, the checkpoint's dim (see the module's note):
    HF's rotated halves at ``[0, R/2)`` and ``[D/2, D/2 + R/2)``, its passed dims after each."""
    half, rhalf = head_dim // 2, rotary_dim // 2
    passed = torch.arange(rotary_dim, head_dim)
    npass = half - rhalf
    return torch.cat([torch.arange(rhalf), passed[:npass],
                      torch.arange(rhalf, rotary_dim), passed[npass:]])


def reorder_head_rows(tensor: torch.Tensor, num_heads: int, order: torch.Tensor) -> torch.Tensor:
    """``tensor``'s rows (q or k of ``num_heads`` heads, weight or bias) in ``order`` within
    each head."""
    head_dim = order.numel()
    if tensor.shape[0] != num_heads * head_dim:
        return tensor  # the shape check of the loader names it
    rows = tensor.reshape(num_heads, head_dim, *tensor.shape[1:])
    return rows.index_select(1, order.to(tensor.device)).reshape(tensor.shape)
