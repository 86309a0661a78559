"""Our models through the paged cache against Hugging Face transformers, and batching invariance."""

from __future__ import annotations

import torch
from hf_checkpoints import Checkpoint
from paged import PagedKVCache, run_step

PROMPT_LENS = (5, 17, 1, 33)  # within, across and exactly at block boundaries; one single token
DECODE_STEPS = 3


def prompts(vocab: int, lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


@torch.no_grad()
def hf_logits(ckpt: Checkpoint, ids: list[int]) -> torch.Tensor:
    return ckpt.hf_model(torch.tensor([ids])).logits[0].float()


def test_logits_match_transformers(checkpoint: Checkpoint) -> None:
    """All prompts prefilled in one step, then decode-only steps: every position's logits."""
    seqs = prompts(checkpoint.arch.vocab_size, PROMPT_LENS)
    cache = PagedKVCache.for_arch(checkpoint.arch, num_blocks=32, block_size=16)
    ours = [[x] for x in run_step(checkpoint.model, cache, list(enumerate(seqs)))]
    gen = torch.Generator().manual_seed(1)
    for _ in range(DECODE_STEPS):
        new = torch.randint(0, checkpoint.arch.vocab_size, (len(seqs),), generator=gen).tolist()
        for seq, tok in zip(seqs, new, strict=True):
            seq.append(tok)
        step = run_step(checkpoint.model, cache, [(i, [t]) for i, t in enumerate(new)])
        for acc, logits in zip(ours, step, strict=True):
            acc.append(logits)
    for i, seq in enumerate(seqs):
        got = torch.cat(ours[i])
        want = hf_logits(checkpoint, seq)
        assert got.dtype == torch.float32
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff <= 1e-3, f"sequence {i} (len {len(seq)}): max |diff| {diff}"


def test_chunked_prefill_equals_one_shot(llama: Checkpoint) -> None:
    (ids,) = prompts(llama.arch.vocab_size, (37,), seed=2)
    one = PagedKVCache.for_arch(llama.arch, block_size=16)
    (whole,) = run_step(llama.model, one, [(0, ids)])
    chunked = PagedKVCache.for_arch(llama.arch, block_size=16, seed=5)
    parts = [run_step(llama.model, chunked, [(0, ids[a:b])])[0]
             for a, b in ((0, 12), (12, 24), (24, 37))]
    assert (torch.cat(parts) - whole).abs().max().item() <= 1e-4


def test_mixed_batch_equals_separate_steps(llama: Checkpoint) -> None:
    """A prefill chunk of one sequence and decodes of others in one step, or one at a time."""
    a, b, c = prompts(llama.arch.vocab_size, (20, 10, 18), seed=3)
    cache = PagedKVCache.for_arch(llama.arch, block_size=16)
    run_step(llama.model, cache, [(0, a[:11]), (1, b), (2, c)])
    separate = cache.clone()
    batch = [(1, [7]), (0, a[11:]), (2, [9])]
    mixed = run_step(llama.model, cache, batch)
    alone = [run_step(llama.model, separate, [item])[0] for item in batch]
    for got, want in zip(mixed, alone, strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-4
    # Both ways wrote the same keys and values.
    for x, y in zip(cache.kv_caches, separate.kv_caches, strict=True):
        assert (x - y).abs().max().item() <= 1e-4


def test_decode_batch_equals_per_sequence(llama: Checkpoint) -> None:
    seqs = prompts(llama.arch.vocab_size, (3, 16, 30, 9), seed=4)
    cache = PagedKVCache.for_arch(llama.arch, block_size=16)
    run_step(llama.model, cache, list(enumerate(seqs)))
    separate = cache.clone()
    batch = [(i, [i + 40]) for i in range(len(seqs))]
    together = run_step(llama.model, cache, batch)
    alone = [run_step(llama.model, separate, [item])[0] for item in batch]
    assert torch.equal(torch.cat(together).argmax(-1), torch.cat(alone).argmax(-1))
    assert (torch.cat(together) - torch.cat(alone)).abs().max().item() <= 1e-5


def test_bfloat16_close_to_float32(llama: Checkpoint) -> None:
    (ids,) = prompts(llama.arch.vocab_size, (21,), seed=6)
    model16 = type(llama.model)(llama.arch)
    model16.load_weights((n, p) for n, p in _hf_named(llama))
    model16 = model16.to(torch.bfloat16)
    cache = PagedKVCache.for_arch(llama.arch, dtype=torch.bfloat16)
    (got,) = run_step(model16, cache, [(0, ids)])
    (want,) = run_step(llama.model, PagedKVCache.for_arch(llama.arch), [(0, ids)])
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 0.1 * want.abs().max().item()


def _hf_named(ckpt: Checkpoint) -> list[tuple[str, torch.Tensor]]:
    return list(ckpt.hf_model.state_dict().items())
