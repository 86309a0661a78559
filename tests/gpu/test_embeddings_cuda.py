"""Embeddings on a real GPU: a random BERT checkpoint (the encoder path, no KV cache, whole
requests in one step) gives transformers' pooled states, in fp32 and in bf16. Skips without
CUDA (CI has none); tests/embed runs the same comparisons on the CPU."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS / "models"))
sys.path.insert(0, str(TESTS / "embed"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_bert_on_cuda_gives_the_pooled_states_of_transformers(
        tmp_path: Path, dtype: str, pooling: str) -> None:
    from embed_helpers import save_random_bert
    from hf_checkpoints import write_tokenizer

    from tokenmill import LLM
    from tokenmill.sampling_params import PoolingParams

    # A word-level tokenizer ("t0" .. "t999"): the device carries no model files.
    (tmp_path / "tok").mkdir()
    write_tokenizer(tmp_path / "tok", vocab_size=1000)
    hf = save_random_bert(tmp_path / "bert", str(tmp_path / "tok"), seed=3)
    texts = ["t5 t9 t13", " ".join(f"t{(11 * i) % 997 + 3}" for i in range(40)), "t7"]
    llm = LLM(str(tmp_path / "bert"), device="cuda", pooling=pooling, dtype=dtype)
    try:
        assert llm.engine.task == "embed"
        outs = llm.embed(texts, PoolingParams(normalize=False))
    finally:
        llm.close()
    for out in outs:
        with torch.no_grad():
            states = hf(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        ref = states.mean(0) if pooling == "mean" else states[0]
        got = torch.tensor(out.embedding)
        if dtype == "float32":
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        else:  # bf16 matmuls (and the wide random init): within 6% of the vector's length
            assert ((got - ref).norm() / ref.norm()).item() < 0.06
    del llm
    gc.collect()
    torch.cuda.empty_cache()
