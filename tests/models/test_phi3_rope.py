"""Longrope and partial rotary (models/rope_scaling.py) against transformers' own functions,
and how Phi-3 / Phi-4 configs are read (both transformers layouts) and refused."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tokenmill.models.config import ArchConfig
from tokenmill.models.kernel_binding import torch_rotary
from tokenmill.models.layers import RotaryEmbedding
from tokenmill.models.registry import get_model_class
from tokenmill.models.rope_scaling import (
    longrope_inv_freq,
    partial_rotary_row_order,
    reorder_head_rows,
    rope_attention_factor,
)

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402

SHORT = [1.0 + 0.05 * i for i in range(24)]
LONG = [1.0 + 0.9 * i for i in range(24)]


def phi3_config(partial: float = 0.75, **kwargs: Any) -> Any:
    """Phi-4-mini's rope in small: head_dim 64, 48 rotated dims, 4k -> 128k longrope."""
    params = dict(vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                  max_position_embeddings=131072, original_max_position_embeddings=4096,
                  partial_rotary_factor=partial,
                  rope_scaling=dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG))
    params.update(kwargs)
    return transformers.Phi3Config(**params)


@pytest.mark.parametrize("long", [False, True])
def test_longrope_frequencies_and_factor_equal_transformers(long: bool) -> None:
    config = phi3_config()
    seq_len = 4097 if long else None
    want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    scaling = dict(config.rope_parameters)
    scaling.setdefault("factor", 131072 / 4096)
    got = longrope_inv_freq(48, scaling["rope_theta"], scaling, 131072 if long else 4096)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)
    assert want_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


def test_partial_rotary_by_row_order_equals_transformers() -> None:
    """The full-width rotate-half on reordered q/k rows is HF's partial rope, reordered."""
    config = phi3_config()
    hf_rope = modeling_phi3.Phi3RotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 4095, 4096, 70000])
    x = torch.randn(1, len(positions), 64)
    cos, sin = hf_rope(x, positions[None])
    q = torch.randn(1, 4, len(positions), 64, generator=torch.Generator().manual_seed(0))
    want, _ = modeling_phi3.apply_rotary_pos_emb(q, q, cos, sin)
    scaling = dict(config.rope_parameters, factor=32.0)
    ours = RotaryEmbedding(64, 131072, scaling["rope_theta"], scaling, rotary_dim=48)
    c, s = ours.cos_sin(positions, torch.float32)
    order = partial_rotary_row_order(64, 48)
    rows = q[0].transpose(0, 1)  # [T, H, D]
    got = torch_rotary(rows[..., order], c, s)
    torch.testing.assert_close(got, want[0].transpose(0, 1)[..., order], rtol=1e-5, atol=1e-5)


def test_row_order_is_a_permutation_that_pairs_the_rotated_halves() -> None:
    order = partial_rotary_row_order(16, 12)
    assert sorted(order.tolist()) == list(range(16))
    for i in range(6):  # HF's pair (i, i + 6) lands on rotate-half's (i, i + 8)
        assert (order[i].item(), order[i + 8].item()) == (i, i + 6)
    w = torch.arange(2 * 16 * 3).reshape(32, 3)
    back = reorder_head_rows(w, 2, order)
    assert torch.equal(back.reshape(2, 16, 3)[:, :6], w.reshape(2, 16, 3)[:, :6])


def test_config_transformers4_layout() -> None:
    """Phi-3-mini-128k's config.json as published: "su" (or "longrope") beside a top-level
    original context; the context capped by the sliding window as for every family."""
    d = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32064, "hidden_size": 3072,
         "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 32, "max_position_embeddings": 131072,
         "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
         "rope_scaling": {"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
         "sliding_window": 262144, "hidden_act": "silu", "rms_norm_eps": 1e-5}
    arch = ArchConfig.from_hf_dict(d)
    assert arch.rope_scaling["rope_type"] == "longrope"
    assert arch.rope_scaling["original_max_position_embeddings"] == 4096
    assert arch.rope_scaling["factor"] == 32.0
    assert (arch.rotary_dim, arch.max_position_embeddings) == (96, 131072)


def test_config_transformers5_layout_keeps_the_partial_factor() -> None:
    d = phi3_config().to_dict()
    d["architectures"] = ["Phi3ForCausalLM"]
    arch = ArchConfig.from_hf_dict(d)
    assert arch.partial_rotary_factor == 0.75 and arch.rotary_dim == 48
    assert "partial_rotary_factor" not in arch.rope_scaling
    plain = phi3_config(partial=1.0, rope_scaling=None).to_dict()
    plain["architectures"] = ["Phi3ForCausalLM"]
    assert ArchConfig.from_hf_dict(plain).rope_scaling is None


def test_bad_rope_configs_name_the_field() -> None:
    d = phi3_config().to_dict()
    d["architectures"] = ["Phi3ForCausalLM"]
    d["rope_parameters"]["short_factor"] = [1.0] * 5
    with pytest.raises(ValueError, match=r"rope_scaling\.short_factor must list 24"):
        ArchConfig.from_hf_dict(d)
    d = phi3_config().to_dict()
    d["architectures"] = ["Phi3ForCausalLM"]
    d["partial_rotary_factor"] = 0.3  # 19.2 -> 19 dims: not pairs
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ArchConfig.from_hf_dict(d)


def test_a_family_without_the_row_order_refuses_partial_rotary() -> None:
    arch = ArchConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64,
                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=16, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported for "
                                         "LlamaForCausalLM"):
        get_model_class([arch.architecture])(arch)
