"""Fixtures of the tensor-parallel tests: tiny Hugging Face folders, tokenizer included.

Reuses ``tests/models/hf_checkpoints.py`` (put on ``sys.path``, as ``tests/models/paged.py``
invites). The fused C++ decode stack stays off in this folder: tensor parallelism turns it
off anyway, and the single-process references should compute the same way without paying
for a compile.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from hf_checkpoints import COMMON, make_checkpoint, randomize, write_tokenizer  # noqa: E402

VOCAB_SIZE = 256  # hf_checkpoints.COMMON's
EOS_ID = 2


@pytest.fixture(scope="module", autouse=True)
def _no_fused_decode() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_FUSED_DECODE", "0")
        yield


def _folder(family: str, factory: pytest.TempPathFactory) -> str:
    checkpoint = make_checkpoint(family, factory.mktemp(f"tp_{family}"))
    write_tokenizer(checkpoint.path)
    return str(checkpoint.path)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama, 4 query / 2 KV heads, untied head, llama3 rope."""
    return _folder("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3: q/k norms, head_dim 32 != hidden / heads, tied embedding."""
    return _folder("qwen3", tmp_path_factory)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2: q/k/v biases."""
    return _folder("qwen2", tmp_path_factory)


@pytest.fixture(scope="session")
def llama_bias_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama with every bias (the row-parallel ones are added by rank 0 alone) and a
    vocabulary of 255 that two ranks split into padded shards of 128 rows."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": 255}, num_attention_heads=4,
                                      num_key_value_heads=2, attention_bias=True,
                                      mlp_bias=True, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    randomize(model, seed=11)
    path = tmp_path_factory.mktemp("tp_llama_bias")
    model.save_pretrained(path)
    write_tokenizer(path, 255)
    return str(path)
