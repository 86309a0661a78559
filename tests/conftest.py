"""Fixtures shared by the whole suite: the embedded model, loaded once."""

from __future__ import annotations

import os

import pytest
import torch

# Tests compare numbers: keep them deterministic and the 2-core machine uncontended.
torch.manual_seed(0)

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads the
# variable when it is imported and when kernels are defined, so it is set before any test
# module can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The entry points freeze their start-up heap out of garbage collection (utils.
# freeze_startup_heap). Many tests call them inside this one process, where engines come and
# go: frozen, an engine dropped later in a reference cycle would never be freed. Off here;
# tests/unit/test_gc_freeze.py checks it in processes of their own.
os.environ.setdefault("TOKENMILL_GC_FREEZE", "0")


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from tokenmill.model_loader.gguf import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def llm():
    """The embedded SmolLM2-135M-Instruct in fp32 with a modest KV cache, unquantized: the one
    that is compared with transformers."""
    from tokenmill import LLM

    return LLM(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=256 << 20,
               max_num_batched_tokens=512, quantization="none")


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: str):
    """transformers' own model from the same GGUF file: the reference."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(smollm_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model
