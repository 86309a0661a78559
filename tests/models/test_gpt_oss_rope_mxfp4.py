"""gpt-oss's YaRN rope and MXFP4 experts against transformers' own functions: the frequencies
and attention factor of ``_compute_yarn_parameters`` over several configs, the dequantization
of ``transformers.integrations.mxfp4`` on random blocks, and an MXFP4 checkpoint loading the
same experts as the float checkpoint transformers' conversion makes of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gpt_oss_checkpoint import make_gpt_oss_checkpoint
from hf_checkpoints import Checkpoint, load_ours
from safetensors.torch import load_file, save_file

from tokenmill.models.config import ArchConfig
from tokenmill.models.layers import RotaryEmbedding, rope_inv_freq
from tokenmill.models.mxfp4 import dequantize_mxfp4
from tokenmill.models.rope_scaling import rope_attention_factor

transformers = pytest.importorskip("transformers")

YARN_CASES = {
    "gpt-oss": dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096),
    "truncated": dict(factor=8.0, original_max_position_embeddings=2048),
    "mscale": dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707, beta_fast=16, beta_slow=2,
                   original_max_position_embeddings=4096),
    "attention_factor": dict(factor=4.0, attention_factor=1.25,
                             original_max_position_embeddings=1024),
    "no_factor": dict(factor=None, original_max_position_embeddings=8192),  # growth: 16
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_equals_transformers(case: str) -> None:
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **YARN_CASES[case]}
    hf_config = transformers.GptOssConfig(head_dim=64, hidden_size=2880, num_attention_heads=64,
                                          max_position_embeddings=131072,
                                          rope_parameters=dict(params))
    want_freq, want_factor = _compute_yarn_parameters(hf_config)
    arch = ArchConfig.from_hf_dict({**hf_config.to_dict(), "architectures": ["GptOssForCausalLM"]})
    assert arch.rope_scaling is not None
    got = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    torch.testing.assert_close(got, want_freq.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(arch.rope_scaling) == pytest.approx(want_factor, rel=1e-12)
    # The rotary's tables carry the factor, as transformers' cos and sin do.
    rotary = RotaryEmbedding(arch.head_dim, 64, arch.rope_theta, arch.rope_scaling)
    assert rotary.cos_half[0, 0].item() == pytest.approx(want_factor, rel=1e-6)


def test_mxfp4_dequantization_equals_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    got = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    assert got.shape == (3, 10, 128)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=0, atol=0)
    # Byte values held as floats (a loader casting to the model's dtype) give the same.
    torch.testing.assert_close(dequantize_mxfp4(blocks.bfloat16(), scales.bfloat16()), got,
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="MXFP4 blocks of shape"):
        dequantize_mxfp4(blocks, scales[..., :3])


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def _mxfp4_pair(shape: tuple[int, ...], gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(blocks, scales)`` of ``[E, out, in]`` weights; scales near 2^-3."""
    e, out, width = shape
    blocks = torch.randint(0, 256, (e, out, width // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 126, (e, out, width // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_checkpoint_loads_as_transformers_converts_it(gpt_oss: Checkpoint,
                                                            tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weights = load_file(gpt_oss.path / "model.safetensors")
    packed, converted = dict(weights), dict(weights)
    gen = torch.Generator().manual_seed(1)
    hidden, inter = gpt_oss.arch.hidden_size, gpt_oss.arch.moe_intermediate_size
    for i in range(gpt_oss.arch.num_hidden_layers):
        for proj, (out, width) in {"gate_up_proj": (2 * inter, hidden),
                                   "down_proj": (hidden, inter)}.items():
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = _mxfp4_pair((gpt_oss.arch.num_experts, out, width), gen)
            del packed[name]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            converted[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    config = json.loads((gpt_oss.path / "config.json").read_text())
    folders = {}
    for kind, tensors, extra in [("float", converted, {}),
                                 ("mxfp4", packed, {"quantization_config": {
                                     "quant_method": "mxfp4"}})]:
        folders[kind] = tmp_path / kind
        folders[kind].mkdir()
        (folders[kind] / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(tensors, folders[kind] / "model.safetensors")
    ours_float, _ = load_ours(folders["float"])
    ours_packed, _ = load_ours(folders["mxfp4"])
    for (name, a), (_, b) in zip(ours_float.named_parameters(), ours_packed.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    # The float folder is what transformers makes of the MXFP4 one: its parity holds.
    hf = transformers.GptOssForCausalLM.from_pretrained(folders["float"], dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    ids = torch.arange(3, 23)[None]
    from paged import PagedKVCache, run_step

    (ours,) = run_step(ours_packed, PagedKVCache.for_arch(gpt_oss.arch, block_size=4),
                       [(0, ids[0].tolist())])
    with torch.no_grad():
        want = hf(ids).logits[0]
    assert (ours - want).abs().max().item() <= 1e-3


def test_mxfp4_half_pair_refused(gpt_oss: Checkpoint, tmp_path: Path) -> None:
    weights = load_file(gpt_oss.path / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    blocks, _ = _mxfp4_pair((6, 64, 32), torch.Generator().manual_seed(2))
    del weights[name]
    weights[f"{name}_blocks"] = blocks
    (tmp_path / "config.json").write_text((gpt_oss.path / "config.json").read_text())
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj_blocks came without its other half"):
        load_ours(tmp_path)
