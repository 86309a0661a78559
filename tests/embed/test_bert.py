"""The BERT encoder against transformers' BertModel on random checkpoints: token states over
a flat batch of mixed lengths, loading (bare and "bert."-prefixed names, missing and
unexpected tensors), and pooling through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from embed_helpers import save_random_bert
from safetensors.torch import load_file, save_file

from tokenmill import LLM
from tokenmill.config import ModelConfig
from tokenmill.model_loader import load_model
from tokenmill.runner.pooling import EncoderBatch
from tokenmill.sampling_params import PoolingParams

# Equal lengths share one attention call, a length of its own gets one: both paths run.
LENGTHS = (1, 5, 17, 5, 3, 5, 40)


def _token_states(folder: Path, seqs: list[list[int]], dtype: str = "float32",
                  bf16_matmuls: bool = False) -> torch.Tensor:
    """Final token states of ``seqs`` as one flat batch; fp32 throughout unless
    ``bf16_matmuls`` (whatever this CPU's "auto" would pick)."""
    loaded = load_model(ModelConfig(model=str(folder), dtype=dtype), torch.device("cpu"),
                        torch.float32)
    if bf16_matmuls:
        loaded.model.use_bf16_matmuls()
    batch = EncoderBatch()
    for ids in seqs:
        batch.add(ids, 0, [])
    input_ids, positions, meta = batch.build(None, [], torch.device("cpu"))  # type: ignore[arg-type]
    with torch.inference_mode():
        return loaded.model(input_ids, positions, meta)


def _random_seqs(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 30000, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.parametrize("masked_lm", [False, True], ids=["BertModel", "BertForMaskedLM"])
def test_token_states_match_transformers(tmp_path: Path, minilm_path: str,
                                         masked_lm: bool) -> None:
    hf = save_random_bert(tmp_path, minilm_path, masked_lm=masked_lm)
    seqs = _random_seqs()
    ours = _token_states(tmp_path, seqs)
    row = 0
    with torch.no_grad():
        for ids in seqs:
            ref = hf(input_ids=torch.tensor([ids])).last_hidden_state[0]
            got = ours[row:row + len(ids)]
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
            row += len(ids)
    assert row == ours.shape[0]


def test_bf16_matmuls_stay_close_to_transformers(tmp_path: Path, minilm_path: str) -> None:
    """The projections in bf16 around an fp32 model (the "auto" dtype on CPUs with native
    bf16): every token state within bf16 rounding of transformers' fp32 one, in fp32."""
    hf = save_random_bert(tmp_path, minilm_path)
    seqs = _random_seqs()
    ours = _token_states(tmp_path, seqs, bf16_matmuls=True)
    assert ours.dtype == torch.float32
    exact = _token_states(tmp_path, seqs)
    assert not torch.equal(ours, exact)  # the bf16 path really ran
    row = 0
    with torch.no_grad():
        for ids in seqs:
            ref = hf(input_ids=torch.tensor([ids])).last_hidden_state[0]
            got = ours[row:row + len(ids)]
            cos = torch.nn.functional.cosine_similarity(got, ref, dim=1)
            assert cos.min() > 0.999, cos.min()
            assert (got - ref).norm() / ref.norm() < 0.02
            row += len(ids)


@pytest.mark.parametrize(("native_bf16", "dtype", "expected"), [
    (True, "auto", True), (False, "auto", False), (True, "float32", False)])
def test_auto_dtype_takes_bf16_matmuls_only_on_native_bf16(
        tmp_path: Path, minilm_path: str, monkeypatch: pytest.MonkeyPatch, native_bf16: bool,
        dtype: str, expected: bool) -> None:
    import tokenmill.model_loader as loader
    from tokenmill.models.layers import Bf16MatmulLinear

    save_random_bert(tmp_path, minilm_path)
    monkeypatch.setattr(loader, "dense_dtype",
                        lambda _d: torch.bfloat16 if native_bf16 else torch.float32)
    model = loader.load_model(ModelConfig(model=str(tmp_path), dtype=dtype),
                              torch.device("cpu"), torch.float32).model
    projections = [m for layer in model.layers
                   for m in (layer.qkv, layer.attn_out, layer.inter, layer.out)]
    assert all(isinstance(m, Bf16MatmulLinear) == expected for m in projections)
    if expected:
        assert all(m.weight.dtype == torch.bfloat16 for m in projections)
    # Embeddings and norms stay fp32 either way.
    assert model.embeddings.word_embeddings.weight.dtype == torch.float32
    assert model.layers[0].attn_norm.weight.dtype == torch.float32


def test_missing_and_unexpected_tensors_are_errors(tmp_path: Path, minilm_path: str) -> None:
    save_random_bert(tmp_path, minilm_path)
    weights = load_file(tmp_path / "model.safetensors")
    name = "encoder.layer.1.attention.self.key.bias"
    save_file({k: v for k, v in weights.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensors.*layer.1.attention.self.key.bias"):
        _token_states(tmp_path, [[101, 102]])
    save_file({**weights, "encoder.layer.9.output.dense.weight": torch.zeros(2, 2)},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'encoder.layer.9.output.dense"):
        _token_states(tmp_path, [[101, 102]])


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_engine_pooling_matches_transformers(tmp_path: Path, minilm_path: str,
                                             pooling: str) -> None:
    hf = save_random_bert(tmp_path, minilm_path, seed=3)
    texts = ["a short one", "a somewhat longer sentence, with punctuation!", "x"]
    llm = LLM(str(tmp_path), pooling=pooling, dtype="float32")
    try:
        assert llm.engine.task == "embed"  # the default for an encoder
        outs = llm.embed(texts, PoolingParams(normalize=False))
        normed = llm.embed(texts)
    finally:
        llm.close()
    for out, norm_out in zip(outs, normed, strict=True):
        with torch.no_grad():
            states = hf(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        ref = {"cls": states[0], "mean": states.mean(0), "max": states.amax(0)}[pooling]
        torch.testing.assert_close(torch.tensor(out.embedding), ref, atol=2e-5, rtol=1e-4)
        unit = torch.nn.functional.normalize(ref, dim=0)
        torch.testing.assert_close(torch.tensor(norm_out.embedding), unit, atol=2e-6, rtol=1e-4)


def test_encoder_cannot_generate(tmp_path: Path, minilm_path: str) -> None:
    save_random_bert(tmp_path, minilm_path)
    with pytest.raises(ValueError, match="task 'generate' needs a decoder"):
        LLM(str(tmp_path), task="generate")
