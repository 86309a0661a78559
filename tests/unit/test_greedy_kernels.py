"""The CUDA greedy kernel (argmax + its logprob in one pass) against torch.argmax and
``logprobs_of``, and ``Sampler.greedy``'s dispatch to it.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (fp32 and fp16; the
interpreter gets bf16 wrong, so bf16 is compared on CUDA only, in tests/gpu).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning")  # the NaN rows, in the interpreter

pytest.importorskip("triton")

from tokenmill.kernels.triton import greedy as greedy_kernels  # noqa: E402
from tokenmill.runner import sampler  # noqa: E402
from tokenmill.runner.sampler import Sampler, logprobs_of  # noqa: E402
from tokenmill.runner.sampling_metadata import SamplingMetadata  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
INF, NAN = float("inf"), float("nan")


def _check(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, lps = greedy_kernels.greedy_with_logprobs(logits)
    want = logits.float().argmax(dim=-1)
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32
    assert torch.equal(ids, want), (ids, want)
    torch.testing.assert_close(lps, logprobs_of(logits.float(), want), rtol=1e-5, atol=1e-5,
                               equal_nan=True)
    return ids, lps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [
    (1, 40000),   # split into 10 parts, the last one short
    (2, 20001),   # split, an odd vocab
    (3, 4000),    # one part (shorter than _MIN_PART): two blocks, the second short
    (5, 17),      # a vocab narrower than one block
    (4, 1),
    (130, 300),
])
@pytest.mark.parametrize("split", [True, False])
def test_matches_argmax_and_logprobs_of(dtype: torch.dtype, rows: int, vocab: int,
                                        split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """split=False: as many rows as programs aimed for, so a row is one program (one launch)
    however long."""
    if not split:
        monkeypatch.setattr(greedy_kernels, "_TARGET_PROGRAMS", 1)
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(DEVICE, dtype)
    _check(logits)
    _check(logits * 0.01)  # flat rows: the logprob is about -log(vocab)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first_index(dtype: torch.dtype) -> None:
    """Ties in one lane (columns 2048 apart), across lanes, across parts of a split row, and a
    maximum on the last column."""
    logits = torch.zeros(5, 24000)
    for row, cols in enumerate([(3, 3 + 2048), (2050, 7), (9000, 17000), (23999,), (0, 23999)]):
        logits[row, list(cols)] = 5.0
    logits = logits.to(DEVICE, dtype)
    ids, _ = _check(logits)
    assert ids.tolist() == [3, 7, 9000, 23999, 0]
    assert greedy_kernels.greedy_with_logprobs(logits[:1, :1000])[0].tolist() == [3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_infinities_weigh_nothing(dtype: torch.dtype) -> None:
    """Masked (-inf) entries: every other one, a whole part of a split row, a whole row (id 0
    and a NaN logprob, as torch.argmax and logprobs_of give)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30000, generator=gen)
    logits[0, ::2] = -INF
    logits[1, :20000] = -INF
    logits[2] = -INF
    logits[3, :-1] = -INF
    ids, lps = _check(logits.to(DEVICE, dtype))
    assert ids[2] == 0 and torch.isnan(lps[2])
    assert ids[3] == 29999 and lps[3] == 0.0


def test_nan_wins_as_in_torch_argmax() -> None:
    """The first NaN is the argmax and the logprob is NaN; +inf gives a NaN logprob (inf - inf),
    as PyTorch's does."""
    logits = torch.randn(3, 9000)
    logits[0, [4000, 8000]] = NAN
    logits[0, 10] = 100.0
    logits[1, [20, 8999]] = INF
    ids, lps = _check(logits.to(DEVICE))
    assert ids.tolist() == [4000, 20, int(logits[2].argmax())]
    assert torch.isnan(lps[:2]).all() and not torch.isnan(lps[2])


def test_row_strides_and_bad_input() -> None:
    """A row-strided view is read in place; anything else is refused by name."""
    wide = torch.randn(3, 600, device=DEVICE)
    _check(wide[:, :500])
    ids, lps = greedy_kernels.greedy_with_logprobs(wide[:0])
    assert ids.shape == lps.shape == (0,)
    for bad in (wide.t(), wide[None], wide.double(), wide.long(), wide[:, :0]):
        with pytest.raises(ValueError, match="greedy_with_logprobs"):
            greedy_kernels.greedy_with_logprobs(bad)


def test_sampler_greedy_takes_the_kernel_for_cuda_logits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampler.greedy hands CUDA logits to the kernel in their own dtype (no fp32 copy),
    float64 ones as float32, a strided last dimension made contiguous. Without a GPU the
    dispatch is made to see CPU tensors as CUDA ones and the interpreted kernel runs them."""
    seen: list[torch.Tensor] = []

    def spy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(logits)
        return greedy_kernels.greedy_with_logprobs(logits)

    fake = SimpleNamespace(greedy_with_logprobs=spy)
    monkeypatch.setattr(sampler, "_cuda_greedy_kernels", lambda logits: fake)
    logits = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(1)) * 3).to(DEVICE)
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 6, [[1]] * 6, [[]] * 6,
                                  [None] * 6, [[]] * 6)
    for x in (logits.half(), logits.double(), logits.t().contiguous().t()):
        seen.clear()
        out = Sampler().greedy(x)
        assert out is not None and len(seen) == 1
        assert seen[0].dtype == (torch.float16 if x.dtype == torch.float16 else torch.float32)
        assert seen[0].stride(1) == 1
        full = Sampler()(x.float(), meta)  # the metadata path: the kernel again (fp32)
        assert torch.equal(out.sampled_token_ids, x.float().argmax(-1))
        assert torch.equal(full.sampled_token_ids, out.sampled_token_ids)
        torch.testing.assert_close(out.chosen_logprobs,
                                   logprobs_of(x.float(), out.sampled_token_ids))
    assert Sampler(chosen_logprobs=False).greedy(logits) is None
    monkeypatch.undo()
    assert sampler._cuda_greedy_kernels(logits.cpu()) is None  # CPU logits: the C++ path
