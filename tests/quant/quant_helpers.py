"""Test helper: tiny random models for the quantization tests, and a helper to run them.

Test files in this folder import it as ``from quant_helpers import ...`` (pytest puts the
folder on ``sys.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class

# tests/models/paged.py: the paged-KV-cache test helper shared by the model tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from paged import PagedKVCache, run_step  # noqa: E402


def tiny_arch(architecture: str = "LlamaForCausalLM", tied: bool = True,
              bias: bool = False) -> ArchConfig:
    """Two layers, K = 128 (a multiple of both int4 group sizes), vocab a multiple of 64."""
    return ArchConfig(architecture=architecture, vocab_size=320, hidden_size=128,
                      intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=tied, attention_bias=bias, rms_norm_eps=1e-5)


def tiny_model(arch: ArchConfig, seed: int = 0) -> nn.Module:
    """``arch``'s model in fp32: small layer weights and a large embedding / head, so that the
    logits are peaked like a trained model's rather than chaotic like a random deep net's."""
    model = get_model_class([arch.architecture])(arch)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(noise)
            else:
                p.copy_(0.05 * noise)
    return model.eval()


def logits_of(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of one sequence through a fresh paged KV cache."""
    cache = PagedKVCache.for_arch(model.config)
    return run_step(model, cache, [(0, ids)])[0]


def pack_int4_by_hand(q: torch.Tensor, block_n: int) -> torch.Tensor:
    """The CPU kernel's layout written out: blocks of ``block_n`` rows, each ``[K][block_n/2]``
    bytes with row i low and row i + block_n/2 high; a shorter last block pairs rows 2j, 2j+1."""
    n, k = q.shape
    out = []
    for start in range(0, n, block_n):
        rows = q[start:start + block_n]
        width = rows.shape[0]
        if width == block_n:
            low, high = rows[: width // 2], rows[width // 2:]
        else:
            low, high = rows[0::2], rows[1::2]
        out.append((low | (high << 4)).t().reshape(-1))  # [K][width/2]
    return torch.cat(out).view(n, k // 2)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int4_case(n: int, k: int, group: int, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random nibbles ``[N, K]``, bf16 scales and zeros ``[K / g, N, 2]`` and the fp32 weight
    they encode (``w = (q - 8) * scale + zero``)."""
    q = torch.randint(0, 16, (n, k), generator=gen(seed), dtype=torch.uint8)
    scale = torch.rand(k // group, n, generator=gen(seed + 1)) * 0.02 + 0.001
    zero = torch.randn(k // group, n, generator=gen(seed + 2)) * 0.01
    sz = torch.stack([scale, zero], dim=-1).to(torch.bfloat16)
    s = sz[..., 0].float().t().repeat_interleave(group, dim=1)  # [N, K]
    z = sz[..., 1].float().t().repeat_interleave(group, dim=1)
    return q, sz, (q.float() - 8.0) * s + z
