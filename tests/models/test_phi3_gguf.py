"""Phi-3 / Phi-4 GGUF files as llama.cpp's converter writes them (fused attn_qkv and ffn_up,
rope.dimension_count for partial rotary, rope_factors_long/short tensors and the attention
factor for longrope), written here with the gguf package from a random HF checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hf_checkpoints import Checkpoint
from paged import PagedKVCache, run_step
from test_phi3 import ORIGINAL, make_phi3, prompts

from tokenmill import LLM, SamplingParams
from tokenmill.model_loader.gguf import load_gguf
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class

# HF tensor name (after "model.layers.N.") -> GGUF name (after "blk.N.")
LAYER_NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        return f"blk.{layer}.{LAYER_NAMES[module]}.{leaf}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[hf_name]


def write_phi3_gguf(ckpt: Checkpoint, path: Path, linear_type: Q = Q.F32) -> None:
    """The checkpoint as llama.cpp's Phi3MiniModel converter writes it (SentencePiece vocab of
    256 pieces), its 2-D projections stored as ``linear_type``."""
    cfg = ckpt.hf_model.config
    rope = cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * head_dim)
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(0)  # Phi-4's none
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, cfg.vocab_size)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, cfg.vocab_size)])
    w.add_token_types([2, 3, 3] + [1] * (cfg.vocab_size - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if rope.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"]))
            if scale > 1 else 1.0)
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.array(rope[f"{kind}_factor"], dtype=np.float32))
    for name, tensor in ckpt.hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        qtype = linear_type if array.ndim == 2 and name.startswith("model.layers.") else Q.F32
        w.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def phi4(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_phi3("phi4_mini_long", tmp_path_factory.mktemp("phi4_gguf"))


@pytest.fixture(scope="module")
def phi4_file(phi4: Checkpoint) -> Path:
    path = phi4.path / "phi4.gguf"
    write_phi3_gguf(phi4, path)
    return path


def test_config_equals_the_checkpoints(phi4: Checkpoint, phi4_file: Path) -> None:
    arch = ArchConfig.from_hf_dict(load_gguf(str(phi4_file)).hf_config)
    want = phi4.arch
    assert arch.architecture == "Phi3ForCausalLM"
    assert (arch.rotary_dim, arch.head_dim, arch.num_key_value_heads) == (12, 16, 2)
    assert arch.tie_word_embeddings and arch.max_position_embeddings == 256
    scaling = arch.rope_scaling
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == ORIGINAL
    for key in ("short_factor", "long_factor"):
        assert scaling[key] == pytest.approx(want.rope_scaling[key], rel=1e-6)
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))


@torch.no_grad()
def test_logits_match_transformers(phi4: Checkpoint, phi4_file: Path) -> None:
    model_file = load_gguf(str(phi4_file))
    arch = ArchConfig.from_hf_dict(model_file.hf_config)
    model = get_model_class([arch.architecture])(arch)
    model.load_weights(model_file.tensors())
    seqs = prompts((40, 33), seed=5)
    cache = PagedKVCache.for_arch(arch, num_blocks=16)
    for ids, got in zip(seqs, run_step(model, cache, list(enumerate(seqs))), strict=True):
        want = phi4.hf_model(torch.tensor([ids])).logits[0]
        assert (got - want).abs().max().item() <= 1e-4


def test_engine_answers_from_the_file(phi4: Checkpoint, phi4_file: Path, tmp_path: Path) -> None:
    """Float: greedy tokens equal transformers'. Q8_0 under quantization auto: the fused
    projections are built from the parts of attn_qkv / ffn_up (q/k rows reordered for partial
    rotary) and answer as the same file loaded in float does."""
    ids = prompts((45,), seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = phi4.hf_model.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6,
                                  do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    assert _greedy(str(phi4_file), ids, params, quantization="none") == want
    q8 = tmp_path / "phi4-q8_0.gguf"
    write_phi3_gguf(phi4, q8, Q.Q8_0)
    floats = _greedy(str(q8), ids, params, quantization="none")
    assert _greedy(str(q8), ids, params, quantized=True) == floats


def _greedy(path: str, ids: list[int], params: SamplingParams, quantized: bool = False,
            **kwargs: object) -> list[int]:
    llm = LLM(model=path, dtype="float32", max_model_len=256, num_kv_blocks=32, **kwargs)
    try:
        layer = llm.engine.core.executor.runner.model.model.layers[0]
        for proj in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            assert isinstance(proj, torch.nn.Linear) != quantized  # float, or from the blocks
        return llm.generate([ids], params)[0].outputs[0].token_ids
    finally:
        llm.close()
