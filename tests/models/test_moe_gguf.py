"""Qwen3-MoE (``qwen3moe``) and Mixtral (llama-arch with experts) GGUF files as llama.cpp
writes them (router ``ffn_gate_inp``, experts stacked in ``ffn_{gate,up,down}_exps``), written
here with the ``gguf`` package from a random checkpoint: the same logits as transformers."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from hf_checkpoints import Checkpoint
from paged import PagedKVCache, run_step
from test_models_parity import hf_logits, prompts
from test_moe_parity import make_moe_checkpoint

from tokenmill.model_loader.gguf import load_gguf
from tokenmill.model_loader.hf import iter_safetensors
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class

# HF layer tensor -> llama.cpp's name (the experts are stacked separately).
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
          "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_GATE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation of llama-arch files (what the loader undoes)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(ckpt: Checkpoint, llama_arch: bool) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names, experts stacked [E, out, in]."""
    parts = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
             "down_proj": "down", "w2": "down"}
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    c = ckpt.arch
    for name, t in iter_safetensors(ckpt.path):
        a = t.float().numpy()
        if (m := _EXPERT.fullmatch(name)) is not None:
            experts.setdefault((int(m.group(1)), parts[m.group(3)]), {})[int(m.group(2))] = a
        elif (m := _GATE.fullmatch(name)) is not None:
            out[f"blk.{m.group(1)}.ffn_gate_inp.weight"] = a
        elif name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name == "lm_head.weight":
            out["output.weight"] = a
        else:
            layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name).groups()
            if llama_arch and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads
                a = _permute(a, heads)
            out[f"blk.{layer}.{_LAYER[rest]}.weight"] = a
    for (layer, part), by_expert in experts.items():
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack(
            [by_expert[e] for e in range(len(by_expert))])
    return out


def write_moe_gguf(ckpt: Checkpoint, path: Path, arch: str,
                   experts_type: GGMLQuantizationType = GGMLQuantizationType.F32) -> None:
    c = ckpt.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    for name, array in gguf_tensors(ckpt, arch == "llama").items():
        qtype = experts_type if "_exps" in name else GGMLQuantizationType.F32
        w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _ours_from_gguf(path: Path) -> tuple[torch.nn.Module, ArchConfig]:
    file = load_gguf(str(path))
    arch = ArchConfig.from_hf_dict(file.hf_config)
    model = get_model_class([arch.architecture])(arch)
    model.load_weights(file.tensors())
    return model.eval(), arch


@pytest.mark.parametrize("family,arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_gguf_moe_matches_transformers(family: str, arch: str,
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt = make_moe_checkpoint(family, tmp_path_factory.mktemp(family))
    path = tmp_path_factory.mktemp("gguf") / f"{family}.gguf"
    write_moe_gguf(ckpt, path, arch)
    model, parsed = _ours_from_gguf(path)
    assert parsed.architecture == ckpt.arch.architecture
    assert (parsed.num_experts, parsed.num_experts_per_tok, parsed.moe_intermediate_size) == (
        ckpt.arch.num_experts, ckpt.arch.num_experts_per_tok, ckpt.arch.moe_intermediate_size)
    for (name, got), want in zip(model.state_dict().items(),
                                 ckpt.model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    if family == "mixtral" or ckpt.arch.norm_topk_prob:  # llama.cpp always renormalises
        (ids,) = prompts(parsed.vocab_size, (19,), seed=21)
        (got,) = run_step(model, PagedKVCache.for_arch(parsed), [(0, ids)])
        assert (got - hf_logits(ckpt, ids)).abs().max().item() <= 1e-3


def test_q8_0_experts_dequantized_close(tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt = make_moe_checkpoint("qwen3_moe", tmp_path_factory.mktemp("q8"))
    path = tmp_path_factory.mktemp("gguf_q8") / "q8.gguf"
    write_moe_gguf(ckpt, path, "qwen3moe", GGMLQuantizationType.Q8_0)
    model, _ = _ours_from_gguf(path)
    block, want = model.model.layers[0].mlp.experts, ckpt.model.model.layers[0].mlp.experts
    assert block.w13.shape == want.w13.shape
    err = (block.w13 - want.w13).abs().max().item()
    assert 0 < err <= 0.01 * want.w13.abs().max().item()
