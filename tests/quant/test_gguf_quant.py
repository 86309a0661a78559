"""Quantized layers built from GGUF blocks: Q4_0 / Q4_1 are taken over exactly under int4."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from quant_helpers import logits_of

from tokenmill.config import ModelConfig
from tokenmill.model_loader import load_model, resolve_quantization
from tokenmill.model_loader.gguf import GGUFModel, float_from_gguf, load_gguf
from tokenmill.model_loader.gguf_quantized import int4_groups_from_gguf, load_gguf_quantized
from tokenmill.model_loader.gguf_quantized import quantized_linear_from_gguf as from_gguf
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class
from tokenmill.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear, QuantizedEmbedding

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 96, 64
QKV = "model.layers.0.self_attn.qkv_proj"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (what a llama GGUF stores)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> GGUFModel:
    """A one-layer llama GGUF mixing Q4_1, Q4_0, Q8_0, F16 and F32 tensors."""
    rng = np.random.default_rng(0)

    def r(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale + 0.01).astype(np.float32)

    head_dim = HIDDEN // HEADS
    tensors = {
        "token_embd.weight": (r(VOCAB, HIDDEN, scale=1.0), Q.Q8_0),
        "blk.0.attn_q.weight": (_permute(r(HIDDEN, HIDDEN), HEADS), Q.Q4_1),
        "blk.0.attn_k.weight": (_permute(r(KV_HEADS * head_dim, HIDDEN), KV_HEADS), Q.Q4_0),
        "blk.0.attn_v.weight": (r(KV_HEADS * head_dim, HIDDEN), Q.Q8_0),
        "blk.0.attn_output.weight": (r(HIDDEN, HIDDEN), Q.F16),
        "blk.0.ffn_gate.weight": (r(FFN, HIDDEN), Q.Q4_1),
        "blk.0.ffn_up.weight": (r(FFN, HIDDEN), Q.Q4_1),
        "blk.0.ffn_down.weight": (r(HIDDEN, FFN), Q.Q4_0),
        "blk.0.attn_norm.weight": (1 + r(HIDDEN), Q.F32),
        "blk.0.ffn_norm.weight": (1 + r(HIDDEN), Q.F32),
        "output_norm.weight": (1 + r(HIDDEN), Q.F32),
    }
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_gguf(path, "llama", tensors, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS,
               context_length=256, rms_eps=1e-5)
    return load_gguf(str(path))


def _model(file: GGUFModel) -> torch.nn.Module:
    arch = ArchConfig.from_hf_dict(file.hf_config)
    return get_model_class([arch.architecture])(arch).eval()


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.0.self_attn.k_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight"])
def test_q4_blocks_are_taken_over_bit_for_bit(small_gguf: GGUFModel, name: str) -> None:
    raw = small_gguf.raw_tensor(name)
    groups = int4_groups_from_gguf(raw)
    assert groups.group_size == 32 and int(groups.q.max()) <= 15
    assert torch.equal(groups.dequantize(), float_from_gguf(raw))


def test_fused_qkv_keeps_the_file_nibbles(small_gguf: GGUFModel) -> None:
    module = from_gguf(small_gguf, QKV, "int4")
    assert isinstance(module, Int4WeightOnlyLinear) and module.out_features == 128
    q = small_gguf.raw_tensor("model.layers.0.self_attn.q_proj.weight")
    k = small_gguf.raw_tensor("model.layers.0.self_attn.k_proj.weight")
    nibbles = module.nibbles()
    assert torch.equal(nibbles[:64], int4_groups_from_gguf(q).q)  # Q4_1, exact
    assert torch.equal(nibbles[64:96], int4_groups_from_gguf(k).q)  # Q4_0, exact
    # the whole fused weight, v (Q8_0) requantized, against the file's float values
    exact = torch.cat([float_from_gguf(small_gguf.raw_tensor(
        f"model.layers.0.self_attn.{p}_proj.weight")) for p in "qkv"])
    err = (module.dequantize() - exact).abs()
    # q and k: only the bf16 rounding of the kernel's scale and zero; v: one int4 step
    assert err[:96].max() <= 2**-7 * exact[:96].abs().max()
    assert err[96:].max() <= exact[96:].abs().max() / 15


def test_q8_and_group_64_are_requantized(small_gguf: GGUFModel) -> None:
    int8 = from_gguf(small_gguf, QKV, "int8")
    assert isinstance(int8, Int8WeightOnlyLinear)
    exact = float_from_gguf(small_gguf.raw_tensor("model.layers.0.mlp.gate_proj.weight"))
    g64 = from_gguf(small_gguf, "model.layers.0.mlp.gate_up_proj", "int4", group_size=64)
    assert g64.group_size == 64
    assert (g64.dequantize()[:FFN] - exact).abs().max() <= exact.abs().max() / 15


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_load_gguf_quantized_matches_the_float_model(small_gguf: GGUFModel, method: str) -> None:
    reference = _model(small_gguf)
    reference.load_weights(small_gguf.tensors())
    model = _model(small_gguf)
    built = load_gguf_quantized(model, small_gguf, method)
    assert set(built) == {QKV, "model.layers.0.self_attn.o_proj",
                          "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
                          "model.embed_tokens"}
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)  # tied head, int8
    assert isinstance(model.model.embed_tokens.table, Int8WeightOnlyLinear)
    ids = list(range(1, 40))
    ref, out = logits_of(reference, ids), logits_of(model, ids)
    assert (out - ref).norm() / ref.norm() < (0.03 if method == "int8" else 0.1)
    with pytest.raises(ValueError, match="CPU only"):
        load_gguf_quantized(_model(small_gguf), small_gguf, method, device=torch.device("meta"))


def test_embedded_model_int4_is_the_files_q4_1(smollm_path: str) -> None:
    """Through the loader hook on the real file: layer weights are its Q4_1 blocks."""
    loaded = load_model(ModelConfig(quantization="int4"), torch.device("cpu"), torch.float32)
    file = load_gguf(smollm_path)
    gate_up = loaded.model.model.layers[3].mlp.gate_up_proj
    assert isinstance(gate_up, Int4WeightOnlyLinear)
    raws = [file.raw_tensor(f"model.layers.3.mlp.{p}_proj.weight") for p in ("gate", "up")]
    assert all(r.qtype == Q.Q4_1 for r in raws)
    groups = [int4_groups_from_gguf(r) for r in raws]
    assert torch.equal(gate_up.nibbles(), torch.cat([g.q for g in groups]))
    for g, raw in zip(groups, raws, strict=True):
        assert torch.equal(g.dequantize(), float_from_gguf(raw))
    assert isinstance(loaded.model.model.embed_tokens, QuantizedEmbedding)
    ids = loaded.tokenizer.encode("The capital of France is", add_special_tokens=False)
    logits = logits_of(loaded.model, ids)
    assert torch.isfinite(logits).all() and logits.shape == (len(ids), 49152)


class _FileOfKinds:
    """Stands in for a GGUFModel whose decoder weights have the given block types."""

    def __init__(self, kinds: list[Q]) -> None:
        self._raws = {f"model.layers.{i}.mlp.down_proj.weight": kind for i, kind in enumerate(kinds)}
        self._raws["model.embed_tokens.weight"] = Q.Q8_0

    def tensor_names(self) -> list[str]:
        return list(self._raws)

    def raw_tensor(self, name: str) -> object:
        return SimpleNamespace(qtype=self._raws[name])


# Files of Q4_0 / Q4_1 layers only: their exact int4 groups; any other quantized type: every
# layer keeps its own blocks ("gguf", tokenmill.quant.kquant; issue 58).
@pytest.mark.parametrize(("kinds", "expected"), [
    ([Q.Q4_1] * 3, "int4"), ([Q.Q4_0, Q.Q4_0, Q.Q6_K], "gguf"), ([Q.Q8_0] * 2, "gguf"),
    ([Q.Q6_K, Q.Q5_K, Q.Q4_0], "gguf"), ([Q.F16] * 2, "none"), ([Q.F32, Q.BF16], "none"),
    ([Q.F16, Q.F16, Q.Q4_0], "none"), ([Q.Q4_0, Q.Q4_1, Q.F16], "int4"),
])
def test_auto_follows_the_files_block_types(kinds: list[Q], expected: str) -> None:
    file = _FileOfKinds(kinds)
    assert resolve_quantization("auto", file, torch.device("cpu")) == expected  # type: ignore[arg-type]
    # Other devices and folders: none; an explicit method: itself.
    assert resolve_quantization("auto", file, torch.device("meta")) == "none"  # type: ignore[arg-type]
    assert resolve_quantization("auto", None, torch.device("cpu")) == "none"
    assert resolve_quantization("int8", file, torch.device("cpu")) == "int8"  # type: ignore[arg-type]
    assert resolve_quantization("none", file, torch.device("cpu")) == "none"  # type: ignore[arg-type]


def test_embedded_model_defaults_to_its_own_int4(smollm_path: str) -> None:
    from tokenmill.quant.model import count_parameters, model_weight_bytes

    assert ModelConfig().quantization == "auto"
    loaded = load_model(ModelConfig(), torch.device("cpu"), torch.float32)
    assert loaded.quantization == "int4"
    assert isinstance(loaded.model.model.layers[0].self_attn.qkv_proj, Int4WeightOnlyLinear)
    # SmolLM2-135M: 134.5 M weights whatever their storage; int4 layers + int8 head ~ 93 MiB.
    assert 134e6 < count_parameters(loaded.model) < 135e6
    assert model_weight_bytes(loaded.model) < 100 * 2**20
    plain = load_model(ModelConfig(quantization="none"), torch.device("cpu"), torch.float32)
    assert plain.quantization == "none"
    assert count_parameters(plain.model) == count_parameters(loaded.model)
