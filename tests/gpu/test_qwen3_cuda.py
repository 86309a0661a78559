"""A random Qwen3 checkpoint on a real GPU (per-head q/k norms in one Triton kernel, Triton
attention, CUDA graphs) gives transformers' logprobs, in fp32 and in bf16. Skips without
CUDA (CI has none); the engine's features on the GPU path are in
tests/engine/test_triton_engine_features.py, which runs on either.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-3), ("bfloat16", 0.15)])
def test_qwen3_on_cuda_gives_the_logprobs_of_transformers(
        tmp_path: Path, dtype: str, atol: float, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_checkpoints import make_checkpoint, write_tokenizer

    from tokenmill import LLM, SamplingParams
    from tokenmill.kernels.triton import fused_ops

    norms = []
    head_rms_norm_ = fused_ops.head_rms_norm_

    def counted(*args: object, **kw: object) -> None:
        norms.append(args[0].shape)  # type: ignore[union-attr]
        head_rms_norm_(*args, **kw)

    monkeypatch.setattr(fused_ops, "head_rms_norm_", counted)

    checkpoint = make_checkpoint("qwen3", tmp_path)
    write_tokenizer(tmp_path, vocab_size=checkpoint.arch.vocab_size)
    llm = LLM(str(tmp_path), device="cuda", dtype=dtype, quantization="none",
              max_model_len=128, num_kv_blocks=32)
    assert llm.engine.core.executor.runner.decode_graphs is not None
    prompts = [" ".join(f"t{(7 * i + 3 * j) % 200 + 3}" for j in range(n))
               for i, n in enumerate((5, 17, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        ids = list(out.prompt_token_ids) + list(completion.token_ids)
        with torch.no_grad():
            logits = checkpoint.hf_model(torch.tensor([ids])).logits[0].float()
        want = torch.log_softmax(logits, dim=-1)
        n = len(out.prompt_token_ids)
        got = [lp.logprob for lp in out.prompt_logprobs[1:]]  # type: ignore[index]
        got += [lp.logprob for lp in completion.logprobs]  # type: ignore[union-attr]
        expected = [want[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) <= atol
        if dtype == "float32":  # greedy: transformers' top token at every generated position
            assert completion.token_ids == want[n - 1:-1].argmax(-1).tolist()
    assert norms  # the q/k norms took the one-kernel path
    del llm
    gc.collect()
    torch.cuda.empty_cache()
