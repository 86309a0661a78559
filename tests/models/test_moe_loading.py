"""MoE configs and checkpoints: the fields validated with their names, expert tensors under
every name checkpoints use, and an expert count, width or top-k that does not fit the weights
refused at load naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import Checkpoint, load_ours
from test_moe_parity import make_moe_checkpoint

from tokenmill import LLM
from tokenmill.model_loader.hf import iter_safetensors
from tokenmill.models.config import ArchConfig
from tokenmill.models.moe import SparseMoeBlock
from tokenmill.models.registry import get_model_class, supported_architectures

BASE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": True,
}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_moe_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral_loading"))


def test_config_fields_of_both_families() -> None:
    qwen = ArchConfig.from_hf_dict({**BASE, "mlp_only_layers": [0], "decoder_sparse_step": 1})
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 2, 32)
    assert qwen.norm_topk_prob and qwen.mlp_only_layers == (0,)
    assert [qwen.is_moe_layer(i) for i in range(2)] == [False, True]
    mixtral = ArchConfig.from_hf_dict({**BASE, "architectures": ["MixtralForCausalLM"],
                                       "num_experts": None, "num_local_experts": 4,
                                       "moe_intermediate_size": None})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (4, 128)
    assert ArchConfig.from_hf_dict({**BASE, "num_experts": 0}).num_experts == 0
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM"} <= set(supported_architectures())


@pytest.mark.parametrize("change,field", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"num_experts": -2}, "num_experts"),
    ({"moe_intermediate_size": -1}, "moe_intermediate_size"),
    ({"decoder_sparse_step": -1}, "decoder_sparse_step"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers"),
])
def test_bad_moe_config_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ArchConfig.from_hf_dict({**BASE, **change})


def test_mixtral_without_experts_is_refused() -> None:
    arch = ArchConfig.from_hf_dict({**BASE, "architectures": ["MixtralForCausalLM"],
                                    "num_experts": 0})
    with pytest.raises(ValueError, match="num_local_experts"):
        get_model_class([arch.architecture])(arch)


def test_a_shared_expert_is_refused_not_ignored() -> None:
    arch = ArchConfig.from_hf_dict({**BASE, "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        get_model_class([arch.architecture])(arch)


def test_stacked_expert_tensors_load_like_per_expert_ones(mixtral: Checkpoint) -> None:
    """transformers' in-memory names (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.gate``)
    and the saved per-expert ones (``block_sparse_moe.experts.N.w1``) fill the same model."""
    stacked = mixtral.hf_model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
    model = get_model_class([mixtral.arch.architecture])(mixtral.arch)
    model.load_weights(stacked.items())
    for (name, got), want in zip(model.state_dict().items(),
                                 mixtral.model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def _edited_copy(ckpt: Checkpoint, tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "edited"
    shutil.copytree(ckpt.path, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes,message", [
    (dict(num_local_experts=6), "num_experts is 6"),
    (dict(num_local_experts=10, num_experts_per_tok=2), "num_experts is 10"),
    (dict(intermediate_size=96), "moe_intermediate_size is 96"),
])
def test_experts_that_do_not_fit_the_weights_are_refused_at_load(
        mixtral: Checkpoint, tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    path = _edited_copy(mixtral, tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        load_ours(path)
    with pytest.raises(ValueError, match=message):  # through the engine's loader too
        LLM(str(path), dtype="float32", quantization="none", max_model_len=64)
    # The unedited checkpoint still loads and runs.
    model, _ = load_ours(mixtral.path)
    assert any(isinstance(m, SparseMoeBlock) for m in model.modules())


def test_a_stacked_tensor_with_another_expert_count_is_refused(mixtral: Checkpoint) -> None:
    weights = dict(iter_safetensors(mixtral.path))
    name = "model.layers.1.block_sparse_moe.gate.weight"
    weights[name] = weights[name][:5]
    model = get_model_class([mixtral.arch.architecture])(mixtral.arch)
    with pytest.raises(ValueError, match=f"{name}.*5 experts, but num_experts is 8"):
        model.load_weights(weights.items())
