"""The rejection sampler against known distributions: it must reproduce the target's."""

from __future__ import annotations

import torch
from stats_helpers import chi_square_pvalue

from tokenmill.runner.rejection import (
    draw_randomness,
    greedy_accept,
    rejection_sample,
)

V = 6
K = 2
N = 40_000
P_MIN = 1e-3


def test_greedy_accept() -> None:
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_accept([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # stops at the first mismatch
    assert greedy_accept([4, 6], [5]) == [4]


def _distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(K + 1, V, generator=gen), dim=-1)
    q = torch.softmax(2 * torch.randn(K, V, generator=gen), dim=-1)
    p[0, 3] = 0.0  # a token the target never samples, that the draft proposes often
    q[0, 3] = 0.4
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _sample(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    target = p.expand(N, K + 1, V)
    num = torch.full((N,), K)
    uniforms, exponentials = draw_randomness([K] * N, V, {}, "cpu")
    draft_probs = None if q is None else q.expand(N, K, V)
    return rejection_sample(target, drafts, num, draft_probs, uniforms, exponentials)


def _check(p: torch.Tensor, out: torch.Tensor, counts: torch.Tensor,
           drafts: torch.Tensor) -> None:
    """The first token follows p[0]; given the first draft accepted, the second follows p[1]."""
    first = torch.bincount(out[:, 0], minlength=V)
    assert chi_square_pvalue(first, p[0]) > P_MIN
    accepted = counts > 1
    assert (out[accepted, 0] == drafts[accepted, 0]).all()
    assert (out[~accepted, 0] != drafts[~accepted, 0]).all()
    second = torch.bincount(out[accepted, 1], minlength=V)
    assert chi_square_pvalue(second, p[1]) > P_MIN


def test_draft_distribution_keeps_the_target_distribution() -> None:
    torch.manual_seed(0)
    p, q = _distributions(1)
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True) for i in range(K)], 1)
    out, counts = _sample(p, q, drafts)
    _check(p, out, counts, drafts)
    # Acceptance is min(1, p/q) per token: its mean is sum(min(p, q)).
    rate = (counts > 1).float().mean().item()
    assert abs(rate - torch.minimum(p[0], q[0]).sum().item()) < 0.01


def test_point_mass_drafts_keep_the_target_distribution() -> None:
    torch.manual_seed(1)
    p, _ = _distributions(2)
    # n-gram drafts: the same guess every time, with probability 1 under q.
    drafts = torch.tensor([[1, 4]]).expand(N, K).contiguous()
    out, counts = _sample(p, None, drafts)
    _check(p, out, counts, drafts)
    assert abs((counts > 1).float().mean().item() - p[0, 1].item()) < 0.01


def test_bonus_token_and_padding() -> None:
    p = torch.zeros(2, 3, V)
    p[:, 0, 2] = p[:, 1, 3] = p[:, 2, 4] = 1.0  # one-hot: greedy-like targets
    drafts = torch.tensor([[2, 3], [2, 0]])
    out, counts = rejection_sample(p, drafts, torch.tensor([2, 1]), None,
                                   torch.zeros(2, 2), torch.ones(2, V))
    assert out[0].tolist() == [2, 3, 4] and counts[0] == 3  # both accepted, bonus from p[2]
    assert out[1, :2].tolist() == [2, 3] and counts[1] == 2  # one draft, then p[1]'s token


def test_seeded_rows_draw_only_from_their_generator() -> None:
    def draws(batch_size: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        gens = {row: torch.Generator().manual_seed(7)}
        u, e = draw_randomness([3] * batch_size, V, gens, "cpu")
        return u[row], e[row]

    u1, e1 = draws(1, 0)
    u2, e2 = draws(4, 2)
    assert torch.equal(u1, u2) and torch.equal(e1, e2)
