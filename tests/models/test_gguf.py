"""GGUF loading: tensors and config equal transformers' GGUF loader; dequantization, the q/k
un-permutation and the name/config mapping on small files written here."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf

from tokenmill.model_loader.gguf import (
    GGUFModel,
    dequantize_array,
    embedded_model_path,
    load_gguf,
    unpermute_rows,
)
from tokenmill.model_loader.gguf_header import GGUFHeader

QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
# max |error| allowed per type, as a fraction of the largest |value|
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1,
             Q.Q5_0: 0.07, Q.Q5_1: 0.05, Q.Q8_0: 0.01}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's ``permute``: what the file stores for q/k."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# ---------------------------------------------------------------- the embedded model vs HF


@pytest.fixture(scope="module")
def hf_model() -> Any:
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(embedded_model_path())
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32)


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return load_gguf(embedded_model_path())


def test_tensors_match_transformers(model: GGUFModel, hf_model: Any) -> None:
    expected = hf_model.state_dict()
    seen = set()
    for name, tensor in model.tensors():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        # max |diff| rather than allclose: allclose is ~10x slower on the 28M-value embedding
        assert (tensor - expected[name]).abs().max().item() <= 1e-6, name
        seen.add(name)
    # the file has no output.weight: lm_head is tied to the embedding
    assert seen == set(expected) - {"lm_head.weight"}
    assert model.hf_config["tie_word_embeddings"] is True


def test_hf_config_matches_transformers(model: GGUFModel, hf_model: Any) -> None:
    ours = model.hf_config
    theirs = hf_model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "attention_bias",
                "hidden_act"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rms_norm_eps"] == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert ours["rope_theta"] == pytest.approx(theirs.rope_parameters["rope_theta"])
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["rope_scaling"] is None
    assert ours["rms_norm_eps"] == 1e-5


def test_raw_tensor_keeps_blocks(model: GGUFModel) -> None:
    raw = model.raw_tensor("model.layers.0.mlp.gate_proj.weight")
    assert raw.qtype == Q.Q4_1 and raw.shape == (1536, 576)
    assert raw.data.dtype == np.uint8 and raw.data.shape == (1536, 576 // 32 * 20)
    assert model.raw_tensor("model.embed_tokens.weight").qtype == Q.Q8_0
    with pytest.raises(ValueError, match="no tensor 'nope'"):
        model.raw_tensor("nope")


def test_embedded_tokenizer_and_path(model: GGUFModel) -> None:
    path = embedded_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert model.path == path
    tok = model.tokenizer
    assert tok.vocab_size == 49152 and tok.eos_token_id == 2 and tok.chat_template


# ---------------------------------------------------------------- dequantization, permutation


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantize_round_trip(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((8, 128)).astype(np.float32)
    stored = gguf.quants.quantize(x, qtype)
    y = dequantize_array(stored, qtype)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_array_equal(y, gguf.quants.dequantize(stored, qtype))
    assert np.abs(y - x).max() <= TOLERANCE[qtype] * np.abs(x).max() + 1e-7


def test_q8_0_fast_path_matches_gguf_on_the_embedded_table(model: GGUFModel) -> None:
    """The numpy Q8_0 path gives gguf.quants' exact values on real data: rows of the embedded
    model's tied table (fp16 scales of every magnitude it has), and a 1-D row."""
    raw = model.raw_tensor("model.embed_tokens.weight")
    rows = np.asarray(raw.data[:2048])
    np.testing.assert_array_equal(dequantize_array(rows, Q.Q8_0),
                                  gguf.quants.dequantize(rows, Q.Q8_0))
    np.testing.assert_array_equal(dequantize_array(rows[7], Q.Q8_0),
                                  gguf.quants.dequantize(rows[7], Q.Q8_0))


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_permute(n_head: int) -> None:
    w = np.random.default_rng(n_head).standard_normal((n_head * 64, 40)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rows(permute(w, n_head), n_head), w)
    assert not np.array_equal(permute(w, n_head), w)


# ---------------------------------------------------------------- small files written here

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 96, 32


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]],
           meta: dict[str, Any] | None = None) -> None:
    base = {"add_rope_freq_base": 500000.0, "add_bos_token_id": 1, "add_eos_token_id": 2}
    write_gguf(path, arch, tensors, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS,
               context_length=4096, rms_eps=1e-6, meta={**base, **(meta or {})})


def _weights(seed: int, qwen3: bool = False) -> dict[str, tuple[np.ndarray, Q]]:
    """HF-layout weights for one layer, each in a different storage type."""
    rng = np.random.default_rng(seed)

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    head_dim = 32 if qwen3 else HIDDEN // HEADS
    w = {
        "token_embd.weight": (r(VOCAB, HIDDEN), Q.Q8_0),
        "blk.0.attn_q.weight": (r(HEADS * head_dim, HIDDEN), Q.Q4_0),
        "blk.0.attn_k.weight": (r(KV_HEADS * head_dim, HIDDEN), Q.Q4_1),
        "blk.0.attn_v.weight": (r(KV_HEADS * head_dim, HIDDEN), Q.Q5_0),
        "blk.0.attn_output.weight": (r(HIDDEN, HEADS * head_dim), Q.Q5_1),
        "blk.0.ffn_gate.weight": (r(FFN, HIDDEN), Q.BF16),
        "blk.0.ffn_up.weight": (r(FFN, HIDDEN), Q.F16),
        "blk.0.ffn_down.weight": (r(HIDDEN, FFN), Q.F32),
        "blk.0.attn_norm.weight": (r(HIDDEN), Q.F32),
        "blk.0.ffn_norm.weight": (r(HIDDEN), Q.F32),
        "output_norm.weight": (r(HIDDEN), Q.F32),
        "output.weight": (r(VOCAB, HIDDEN), Q.Q8_0),
    }
    if qwen3:
        w["blk.0.attn_q_norm.weight"] = (r(head_dim), Q.F32)
        w["blk.0.attn_k_norm.weight"] = (r(head_dim), Q.F32)
    return w


def _expected(array: np.ndarray, qtype: Q) -> torch.Tensor:
    stored = gguf.quants.quantize(array, qtype)
    return torch.from_numpy(np.array(gguf.quants.dequantize(stored, qtype), dtype=np.float32))


def test_llama_file_all_types_and_unpermute(tmp_path: Path) -> None:
    hf = _weights(0)
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = (permute(hf["blk.0.attn_q.weight"][0], HEADS), Q.Q4_0)
    stored["blk.0.attn_k.weight"] = (permute(hf["blk.0.attn_k.weight"][0], KV_HEADS), Q.Q4_1)
    _write(tmp_path / "m.gguf", "llama", stored)
    model = load_gguf(str(tmp_path / "m.gguf"))
    got = dict(model.tensors())
    assert len(got) == len(hf)
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (HEADS * 16, HIDDEN)
    names = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
             "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
             "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
             "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    for gguf_name, hf_name in names.items():
        torch.testing.assert_close(got[hf_name], _expected(*hf[gguf_name]), atol=1e-6, rtol=0)
    # the raw blocks come back with rows un-permuted too
    raw = model.raw_tensor("model.layers.0.self_attn.k_proj.weight")
    torch.testing.assert_close(
        torch.from_numpy(dequantize_array(raw.data, raw.qtype)).reshape(raw.shape),
        _expected(*hf["blk.0.attn_k.weight"]), atol=1e-6, rtol=0)
    cfg = model.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["head_dim"] == 16
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is False
    assert (cfg["rope_theta"], cfg["rms_norm_eps"]) == (500000.0, 1e-6)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (VOCAB, 4096)


def test_qwen2_file_has_biases_and_no_permutation(tmp_path: Path) -> None:
    w = _weights(1)
    rng = np.random.default_rng(5)
    for proj, rows in (("q", HIDDEN), ("k", KV_HEADS * 16), ("v", KV_HEADS * 16)):
        w[f"blk.0.attn_{proj}.bias"] = (rng.standard_normal(rows).astype(np.float32), Q.F32)
    del w["output.weight"]
    _write(tmp_path / "q2.gguf", "qwen2", w)
    model = load_gguf(str(tmp_path / "q2.gguf"))
    got = dict(model.tensors())
    torch.testing.assert_close(got["model.layers.0.self_attn.q_proj.weight"],
                               _expected(*w["blk.0.attn_q.weight"]), atol=1e-6, rtol=0)
    torch.testing.assert_close(got["model.layers.0.self_attn.k_proj.bias"],
                               torch.from_numpy(w["blk.0.attn_k.bias"][0]))
    assert "lm_head.weight" not in got
    cfg = model.hf_config
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["attention_bias"] is True
    assert cfg["tie_word_embeddings"] is True


def test_qwen3_file_head_dim_and_qk_norm(tmp_path: Path) -> None:
    w = _weights(2, qwen3=True)
    _write(tmp_path / "q3.gguf", "qwen3", w, {"add_key_length": 32, "add_value_length": 32})
    model = load_gguf(str(tmp_path / "q3.gguf"))
    got = dict(model.tensors())
    torch.testing.assert_close(got["model.layers.0.self_attn.q_norm.weight"],
                               torch.from_numpy(w["blk.0.attn_q_norm.weight"][0]))
    torch.testing.assert_close(got["model.layers.0.self_attn.q_proj.weight"],
                               _expected(*w["blk.0.attn_q.weight"]), atol=1e-6, rtol=0)
    cfg = model.hf_config
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 32


def test_unknown_tensor_and_architecture_are_errors(tmp_path: Path) -> None:
    w = _weights(3)
    w["blk.0.mystery.weight"] = (np.ones(HIDDEN, dtype=np.float32), Q.F32)
    _write(tmp_path / "bad.gguf", "llama", w)
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        load_gguf(str(tmp_path / "bad.gguf"))
    _write(tmp_path / "arch.gguf", "mamba", _weights(3))
    with pytest.raises(ValueError, match="'mamba'"):
        load_gguf(str(tmp_path / "arch.gguf"))
    with pytest.raises(ValueError, match="does not exist"):
        load_gguf(str(tmp_path / "missing.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_gguf(str(tmp_path / "junk.gguf"))


@pytest.mark.parametrize("factor, low, high", [(8.0, 1.0, 4.0), (32.0, 2.0, 8.0)])
def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path, factor: float, low: float,
                                               high: float) -> None:
    theta, dim, original = 500000.0, 128, 8192
    divisors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    w = _weights(4)
    w["rope_freqs.weight"] = (np.array(divisors, dtype=np.float32), Q.F32)
    _write(tmp_path / "l3.gguf", "llama", w, {"add_rope_dimension_count": dim})
    model = load_gguf(str(tmp_path / "l3.gguf"))
    assert model.hf_config["rope_scaling"] == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
        "high_freq_factor": high, "original_max_position_embeddings": original}
    assert "rope_freqs.weight" not in dict(model.tensors())


# ---------------------------------------------------------------- the header reader


def _same_as_gguf_reader(path: str) -> None:
    """GGUFHeader reads every field and tensor as llama.cpp's own GGUFReader does."""
    reference = gguf.GGUFReader(path)
    ours = GGUFHeader(path)
    assert list(ours.fields) == list(reference.fields)[3:]  # GGUFReader adds GGUF.version etc.
    for key, value in ours.fields.items():
        assert value == reference.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type and mine.shape == tuple(theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_header_reader_matches_gguf_reader_on_the_embedded_model() -> None:
    _same_as_gguf_reader(embedded_model_path())


def test_header_reader_matches_gguf_reader_on_every_value_type(tmp_path: Path) -> None:
    meta = {"add_uint32": ("t.u32", 7), "add_int64": ("t.i64", -5), "add_float64": ("t.f64", 0.1),
            "add_bool": ("t.bool", True), "add_string": ("t.str", "héllo"),
            "add_array": ("t.arr", [1, 2, 3])}
    writer = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    for method, (key, value) in meta.items():
        getattr(writer, method)(key, value)
    writer.add_array("t.strs", ["a", "", "ü" * 3])
    writer.add_array("t.floats", [0.5, -1.25])
    for name, (array, qtype) in _weights(3).items():
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_as_gguf_reader(str(tmp_path / "v.gguf"))
    fields = GGUFHeader(str(tmp_path / "v.gguf")).fields
    assert fields["t.strs"] == ["a", "", "üüü"] and fields["t.bool"] is True


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"GGUX" + b[4:], "magic"),
    (lambda b: b[:4] + (9).to_bytes(4, "little") + b[8:], "version 9"),
    (lambda b: b[:200], "past the end"),
])
def test_header_reader_names_a_damaged_file(tmp_path: Path, damage: Any, message: str) -> None:
    good = tmp_path / "good.gguf"
    _write(good, "llama", _weights(4))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(ValueError, match=message):
        GGUFHeader(str(bad))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_gguf(str(bad))
