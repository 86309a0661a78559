"""Embeddings of a decoder (the embedded SmolLM2): last-token or mean pooling of the final
(normed) hidden states, against transformers' LlamaModel on the same GGUF weights."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tokenmill import LLM
from tokenmill.model_loader.gguf import embedded_model_path
from tokenmill.sampling_params import PoolingParams, SamplingParams

TEXTS = ["The capital of France is Paris.", "hi", "Embeddings from a decoder, pooled."]


@pytest.fixture(scope="module")
def hf_llama() -> Any:
    from transformers import AutoModel

    path = embedded_model_path()
    return AutoModel.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                     torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_pooling_matches_transformers(hf_llama: Any, pooling: str) -> None:
    llm = LLM(task="embed", model=embedded_model_path(), pooling=pooling, quantization="none",
              dtype="float32", num_kv_blocks=64)
    try:
        outs = llm.embed(TEXTS)
        singles = [llm.embed(t)[0] for t in TEXTS]
        with pytest.raises(ValueError, match="computes embeddings"):
            llm.generate("hello", SamplingParams(max_tokens=1))
    finally:
        llm.close()
    for out, single in zip(outs, singles, strict=True):
        with torch.no_grad():
            states = hf_llama(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        ref = states[-1] if pooling == "last" else states.mean(0)
        ref = torch.nn.functional.normalize(ref, dim=0)
        got = torch.tensor(out.embedding)
        assert float(torch.dot(got, ref)) > 0.9999
        torch.testing.assert_close(got, torch.tensor(single.embedding), atol=1e-4, rtol=0)


def test_a_generate_engine_refuses_embeddings() -> None:
    llm = LLM(embedded_model_path(), num_kv_blocks=64)
    try:
        assert llm.engine.task == "generate"
        with pytest.raises(ValueError, match="need an engine started with task 'embed'"):
            llm.embed("hello", PoolingParams())
    finally:
        llm.close()
