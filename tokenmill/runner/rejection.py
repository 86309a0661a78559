"""Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept or reject draft tokens
so that every emitted token is distributed exactly as the target model would sample it.

Draft token ``x`` at position ``i``, drawn from the draft distribution ``q_i``, is accepted with
probability ``min(1, p_i(x) / q_i(x))``; the first rejected position instead draws from
``norm(max(0, p_i - q_i))``, and when every draft is accepted one bonus token is drawn from the
target's distribution after the last draft. A proposer without a distribution (n-gram lookup)
is a point mass, ``q_i(x) = 1``: accept with probability ``p_i(x)``, on rejection draw from
``p_i`` without ``x``. Greedy requests are the case where ``p_i`` is one-hot on the argmax:
accept while the draft equals the target's argmax (:func:`greedy_accept`).

Pure torch on padded batches, so it can be tested against known distributions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Floor for the exponential draws of the final token's race (exponential_() can return 0).
_MIN_EXPONENTIAL = 1e-20


def greedy_accept(target_ids: Sequence[int], draft_ids: Sequence[int]) -> list[int]:
    """The emitted tokens of a greedy request: the drafts while they equal the target's argmax
    at their position, then the target's argmax where they first differ (or after the last).

    ``target_ids`` are the argmax ids at the ``len(draft_ids) + 1`` verified positions.
    """
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_ids[n]:
        n += 1
    return [*draft_ids[:n], target_ids[n]]


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniforms: torch.Tensor, exponentials: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify R requests' drafts at once.

    Args:
        target_probs: ``[R, K + 1, V]`` normalized target distributions at each draft position
            and after the last one.
        draft_token_ids: ``[R, K]`` long; rows with fewer drafts are padded (any id).
        num_draft_tokens: ``[R]`` long, each row's real number of drafts (0 < k <= K).
        draft_probs: ``[R, K, V]`` the distributions the drafts were drawn from, or None for
            point masses (n-gram proposals).
        uniforms: ``[R, K]`` U[0, 1) draws for the acceptance tests.
        exponentials: ``[R, V]`` Exp(1) draws for the final token: argmax(w / e) draws from
            the (unnormalized) weights ``w``.

    Returns:
        ``[R, K + 1]`` emitted ids (row r: its first ``counts[r]`` entries) and ``counts`` [R],
        the number of emitted tokens, accepted drafts + 1.
    """
    num_rows, k_max = draft_token_ids.shape
    rows = torch.arange(num_rows, device=target_probs.device)
    positions = torch.arange(k_max, device=target_probs.device)
    p_draft = target_probs[:, :k_max].gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
    # u < p / q, multiplied out: no division by q, and p = 0 is never accepted.
    accepted = (uniforms * q_draft < p_draft) & (positions < num_draft_tokens.unsqueeze(1))
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    final_probs = target_probs[rows, num_accepted]
    rejected = num_accepted < num_draft_tokens
    at = num_accepted.clamp(max=k_max - 1)
    if draft_probs is None:
        residual = final_probs.scatter(1, draft_token_ids[rows, at].unsqueeze(1), 0.0)
    else:
        residual = (final_probs - draft_probs[rows, at]).clamp_min_(0.0)
    # A residual of zero mass can only come from rounding (p == q): p itself is then right.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, final_probs)
    weights = torch.where(rejected.unsqueeze(1), residual, final_probs)
    final = (weights / exponentials.clamp_min(_MIN_EXPONENTIAL)).argmax(dim=1)

    out = torch.cat([draft_token_ids, final.unsqueeze(1)], dim=1)
    out.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return out, num_accepted + 1


def draw_randomness(num_draft_tokens: Sequence[int], vocab_size: int,
                    generators: dict[int, torch.Generator], device: torch.device | str,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms ``[R, K]`` and exponentials ``[R, V]`` for :func:`rejection_sample`.

    A row with a generator (a seeded request) draws only from it, its k uniforms then its V
    exponentials, so its tokens depend on its own draws alone, not on its batch mates.
    """
    num_rows, k_max = len(num_draft_tokens), max(num_draft_tokens)
    uniforms = torch.empty(num_rows, k_max, device=device)
    exponentials = torch.empty(num_rows, vocab_size, device=device)
    if len(generators) < num_rows:  # one batched draw for the unseeded rows
        uniforms.uniform_()
        exponentials.exponential_()
    for i, gen in generators.items():
        uniforms[i, :num_draft_tokens[i]].uniform_(generator=gen)
        exponentials[i].exponential_(generator=gen)
    return uniforms, exponentials
