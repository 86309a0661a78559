"""Models tokenmill cannot run are refused at load with what is wrong: an architecture it does
not support names the supported ones; a GGUF file whose tensors do not match its own
architecture names the tensor (written here with the gguf package). The next load of a good
model is answered as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from hf_checkpoints import write_tokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.model_loader.gguf import load_gguf

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 96, 64
HEAD_DIM = HIDDEN // HEADS


def _tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, Q]]:
    """One llama layer in GGUF names (q/k rows as stored; their order does not matter here)."""
    rng = np.random.default_rng(seed)

    def r(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    return {
        "token_embd.weight": (r(VOCAB, HIDDEN), Q.F32),
        "blk.0.attn_norm.weight": (1 + r(HIDDEN), Q.F32),
        "blk.0.attn_q.weight": (r(HEADS * HEAD_DIM, HIDDEN), Q.Q8_0),
        "blk.0.attn_k.weight": (r(KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0),
        "blk.0.attn_v.weight": (r(KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0),
        "blk.0.attn_output.weight": (r(HIDDEN, HEADS * HEAD_DIM), Q.Q8_0),
        "blk.0.ffn_norm.weight": (1 + r(HIDDEN), Q.F32),
        "blk.0.ffn_gate.weight": (r(FFN, HIDDEN), Q.Q8_0),
        "blk.0.ffn_up.weight": (r(FFN, HIDDEN), Q.Q8_0),
        "blk.0.ffn_down.weight": (r(HIDDEN, FFN), Q.Q4_0),
        "output_norm.weight": (1 + r(HIDDEN), Q.F32),
    }


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> str:
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, VOCAB)]
    meta = {"add_tokenizer_model": "llama", "add_token_list": tokens,
            "add_token_scores": [0.0] * VOCAB, "add_token_types": [2, 3, 3] + [1] * (VOCAB - 3),
            "add_bos_token_id": 1, "add_eos_token_id": 2}
    write_gguf(path, "llama", tensors, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS,
               context_length=256, rms_eps=1e-5, meta=meta)
    return str(path)


def _answers(path: str) -> list[int]:
    llm = LLM(model=path, dtype="float32", max_model_len=128, num_kv_blocks=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        return llm.generate([[1, 5, 9, 13]], params)[0].outputs[0].token_ids
    finally:
        llm.close()


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_a_wrong_shaped_tensor_is_named(tmp_path: Path, quantization: str) -> None:
    bad = _tensors()
    bad["blk.0.attn_k.weight"] = (np.zeros((HEADS * HEAD_DIM, HIDDEN), np.float32), Q.Q8_0)
    path = _write(tmp_path / "bad.gguf", bad)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k\.weight.*\(64, 64\).*\(32, 64\)"):
        LLM(model=path, dtype="float32", quantization=quantization, max_model_len=128,
            num_kv_blocks=16)
    assert len(_answers(_write(tmp_path / "good.gguf", _tensors()))) == 4


@pytest.mark.parametrize("missing", ["blk.0.attn_v.weight", "blk.0.ffn_down.weight",
                                     "output_norm.weight"])
def test_a_missing_tensor_is_named(tmp_path: Path, missing: str) -> None:
    tensors = _tensors()
    del tensors[missing]
    path = _write(tmp_path / "missing.gguf", tensors)
    with pytest.raises(ValueError, match=f"{missing.replace('.', '[.]')}"):
        LLM(model=path, dtype="float32", max_model_len=128, num_kv_blocks=16)


def test_the_good_file_answers(tmp_path: Path) -> None:
    good = _write(tmp_path / "good.gguf", _tensors())
    assert load_gguf(good).hf_config["architectures"] == ["LlamaForCausalLM"]
    assert len(_answers(good)) == 4


@pytest.mark.parametrize("config", [
    # Gemma 2: its activation is not one a supported family takes; the architecture is what
    # to say, not the activation.
    {"architectures": ["Gemma2ForCausalLM"], "hidden_act": "gelu_pytorch_tanh"},
    # Phi-2: partial rotary and a GELU, under a name that is not Phi-3's.
    {"architectures": ["PhiForCausalLM"], "hidden_act": "gelu_new",
     "partial_rotary_factor": 0.4},
    {"architectures": ["MambaForCausalLM"]},
], ids=["gemma2", "phi2", "mamba"])
def test_an_unsupported_architecture_names_the_supported_ones(tmp_path: Path,
                                                              config: dict) -> None:
    d = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 4, **config}
    (tmp_path / "config.json").write_text(json.dumps(d))
    write_tokenizer(tmp_path)
    arch = config["architectures"][0]
    with pytest.raises(ValueError, match=rf"unsupported architectures \['{arch}'\]; "
                                         r"supported: .*LlamaForCausalLM.*Phi3ForCausalLM"):
        LLM(model=str(tmp_path), dtype="float32", max_model_len=128, num_kv_blocks=16)
