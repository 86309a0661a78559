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


def yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's ``[rotary_dim // 2]`` frequencies (gpt-oss): the base ones where a pair turns
    more than ``beta_fast`` times over the pretraining context, divided by ``factor`` where
    it turns fewer than ``beta_slow`` times, a linear ramp between (its ends rounded outwards
    unless ``truncate`` is false); as transformers' ``_compute_yarn_parameters``."""
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero (transformers' guard)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation = 1 - ramp  # the share of each pair's base frequency
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor longrope and YaRN scale cos and sin by (so q.k by its square): the config's
    ``attention_factor``, else longrope's ``sqrt(1 + ln(factor) / ln(original context))`` or
    YaRN's ``0.1 ln(factor) + 1`` (the ratio of two such with ``mscale`` and
    ``mscale_all_dim``); 1 otherwise."""
    rope_type = None if scaling is None else scaling.get("rope_type")
    if scaling is not None and rope_type == "yarn":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor, mscale = float(scaling["factor"]), scaling.get("mscale")
        all_dim = scaling.get("mscale_all_dim")
        if mscale and all_dim:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))
        return _yarn_mscale(factor)
    if scaling is None or rope_type != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if factor <= 1.0:
        return 1.0
    original = int(scaling["original_max_position_embeddings"])
    return math.sqrt(1 + math.log(factor) / math.log(original))


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
