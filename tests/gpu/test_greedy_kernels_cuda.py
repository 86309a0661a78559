"""The greedy kernel compiled on a real GPU against PyTorch on bf16 logits (the interpreter
gets bf16 wrong), at the shapes of a Llama-3.1-8B decode step, and Sampler.greedy taking it.
Skips without CUDA (CI has none)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.runner.sampler import Sampler, logprobs_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
triton = pytest.importorskip("triton")

VOCAB = 128256  # Llama 3's


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen, device="cuda") * 4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, VOCAB), (7, VOCAB), (64, 32000), (256, VOCAB),
                                        (300, 1000), (3, 100)])
def test_matches_pytorch(dtype: torch.dtype, rows: int, vocab: int) -> None:
    """Equal ids (bf16 logits tie often: the first index must win) and logprobs within fp32
    rounding, with ties, masked entries, a max on the last column and a NaN row."""
    from tokenmill.kernels.triton import greedy as greedy_kernels

    logits = _logits(rows, vocab, dtype, rows)
    logits[0, [5, vocab // 2, vocab - 1]] = 50.0  # a tie across parts of a split row
    logits[-1, ::3] = float("-inf")
    if rows > 2:
        logits[1, -1] = 60.0
        logits[2, [vocab // 3, vocab - 2]] = float("nan")
    ids, lps = greedy_kernels.greedy_with_logprobs(logits)
    want = logits.float().argmax(dim=-1)
    assert torch.equal(ids, want)
    torch.testing.assert_close(lps, logprobs_of(logits.float(), want), rtol=1e-5, atol=1e-5,
                               equal_nan=True)


def test_sampler_greedy_takes_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 CUDA logits go to the kernel as they are, and give PyTorch's token and logprob."""
    from tokenmill.kernels.triton import greedy as greedy_kernels

    seen: list[torch.dtype] = []
    kernel = greedy_kernels.greedy_with_logprobs
    monkeypatch.setattr(greedy_kernels, "greedy_with_logprobs",
                        lambda x: seen.append(x.dtype) or kernel(x))
    logits = _logits(256, VOCAB, torch.bfloat16, 0)
    out = Sampler().greedy(logits)
    assert out is not None and seen == [torch.bfloat16]
    want = logits.float().argmax(dim=-1)
    assert torch.equal(out.sampled_token_ids, want)
    torch.testing.assert_close(out.chosen_logprobs, logprobs_of(logits.float(), want),
                               rtol=1e-5, atol=1e-5)
