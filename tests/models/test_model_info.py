"""`tokenmill info` and the start log's model line (model_loader/info.py): family, total and
active parameters, how each part is stored and the KV bytes per token, read from the files'
headers, on the embedded SmolLM2 GGUF and small random Hugging Face checkpoints."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hf_checkpoints import Checkpoint, randomize, write_tokenizer
from safetensors.torch import save_file

from tokenmill.cli import main
from tokenmill.model_loader.gguf import embedded_model_path, load_gguf
from tokenmill.model_loader.info import summarize
from tokenmill.models.config import ArchConfig
from tokenmill.models.registry import get_model_class


def _meta_params(config: dict) -> int:
    """Parameters of our model for ``config``, built on the meta device (no weights)."""
    arch = ArchConfig.from_hf_dict(config)
    with torch.device("meta"):
        model = get_model_class([arch.architecture])(arch)
    return sum(p.numel() for p in model.parameters())


def test_embedded_gguf() -> None:
    path = embedded_model_path()
    s = summarize(path)
    assert (s.family, s.model_type) == ("LlamaForCausalLM", "llama")
    assert s.total_params == s.active_params == _meta_params(load_gguf(path).hf_config)
    assert 134e6 < s.total_params < 135e6
    assert dict(s.storage) == {"embedding": "Q8_0", "attention": "Q4_1", "mlp": "Q4_1",
                               "head": "tied to the embedding", "norms": "F32"}
    assert s.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2


def test_hf_checkpoint_counts_what_transformers_counts(llama: Checkpoint) -> None:
    s = summarize(str(llama.path))
    assert s.family == "LlamaForCausalLM"
    assert s.total_params == s.active_params == llama.hf_model.num_parameters()
    assert dict(s.storage)["head"] == "F32"
    assert s.rows()[2] == ("stored as", "F32 (every part)")
    assert s.kv_bytes_per_token == 2 * 2 * 16 * 2 * 2  # layers, KV heads, head_dim, K+V, 16 bits


def test_mixture_of_experts_active_parameters(tmp_path: Path) -> None:
    """Active = everything but the experts a token does not run: (E - k) / E of theirs."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(config)
    randomize(model, seed=0)
    model.save_pretrained(tmp_path)
    total = model.num_parameters()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 2 * 8 * 3 * 32 * 16
    s = summarize(str(tmp_path))
    assert s.family == "Qwen3MoeForCausalLM"
    assert (s.total_params, s.active_params) == (total, total - experts * 6 // 8)
    assert "active per token" in s.one_line()


def test_quantized_hf_weights_are_counted_unpacked(llama: Checkpoint, tmp_path: Path) -> None:
    """A GPTQ-style folder: int32 qweight holds 8 4-bit weights, scales are no weights."""
    config = json.loads((llama.path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, t in llama.hf_model.state_dict().items():
        if name.endswith("proj.weight"):
            base = name.removesuffix(".weight")
            tensors[f"{base}.qweight"] = torch.zeros(t.shape[1] // 8, t.shape[0],
                                                     dtype=torch.int32)
            tensors[f"{base}.scales"] = torch.zeros(1, t.shape[0], dtype=torch.float16)
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    s = summarize(str(tmp_path))
    assert s.total_params == llama.hf_model.num_parameters()
    assert dict(s.storage)["attention"] == "gptq int4"
    assert dict(s.storage)["embedding"] == "F32"


def test_preset_without_files() -> None:
    s = summarize("llama-3.1-8b")
    assert 8.0e9 < s.total_params < 8.1e9
    assert s.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2


def test_cli_header_only_and_with_the_engine(llama: Checkpoint, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "llama"
    shutil.copytree(llama.path, folder)
    write_tokenizer(folder)
    assert main(["info", str(folder), "--no-load"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM (llama)" in out and "kv bytes per token" in out
    assert "weights in memory" not in out  # nothing was loaded
    with caplog.at_level(logging.INFO, logger="tokenmill.model_loader"):
        assert main(["info", "--model", str(folder), "--max-model-len", "64",
                     "--num-kv-blocks", "8"]) == 0
    out = capsys.readouterr().out
    assert "params total / active" in out and "weights in memory" in out
    # The start log says the same in one line.
    assert any(r.getMessage().startswith("model: LlamaForCausalLM, ") for r in caplog.records)


def test_cli_refuses_an_unsupported_architecture(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPTNeoXForCausalLM"], "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert main(["info", str(tmp_path), "--no-load"]) == 2
    err = capsys.readouterr().err
    assert "unsupported architectures ['GPTNeoXForCausalLM']" in err and "Phi3ForCausalLM" in err
    # The next model is answered as before.
    assert main(["info", embedded_model_path(), "--no-load"]) == 0
