"""The runner's side of speculative decoding: from the target's logits at every verified
position to the tokens a request emits, with every sampling parameter the Sampler applies.

Position j of a request (its last token followed by drafts 1..j) is sampled as if drafts 1..j
were already output tokens: penalties count them and min_tokens sees them. Greedy requests
accept drafts while they equal the argmax; the others go through :func:`rejection_sample`,
drawing only from their own generator when seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.outputs import TokenLogprobs
from tokenmill.runner.rejection import draw_randomness, greedy_accept, rejection_sample
from tokenmill.runner.sampler import (
    apply_logits_processors,
    compute_prompt_logprobs,
    logprobs_of,
    sampling_weights,
)
from tokenmill.runner.sampling_metadata import SamplingMetadata
from tokenmill.sampling_params import SamplingParams


@dataclass
class SpecRequest:
    """One request's draft tokens to verify and what its sampling needs."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    draft_token_ids: list[int]
    generator: torch.Generator | None
    # Ids min_tokens suppresses (eos unless ignore_eos, plus stop_token_ids).
    stop_token_ids: list[int]
    # [>= k, V] the distributions a draft model drew the drafts from; None: point masses.
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifyResult:
    """Per request: the emitted tokens (accepted drafts + 1), their logprobs if asked, and
    their raw logprobs (always)."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    chosen_logprobs: list[list[float]]


def verify_drafts(logits: torch.Tensor, requests: list[SpecRequest],
                  allowed_tokens: tuple[torch.Tensor, list[int]] | None = None) -> VerifyResult:
    """``logits`` ``[sum(k_i + 1), V]``: each request's positions back to back, in order.
    ``allowed_tokens``: the structured outputs' bitmask over those rows (see SamplingMetadata);
    a draft it forbids has probability 0 at its position and is rejected."""
    offsets = [0]
    for r in requests:
        offsets.append(offsets[-1] + len(r.draft_token_ids) + 1)
    raw = logits.float()
    meta = position_metadata(requests, raw.device, allowed_tokens)
    processed = apply_logits_processors(raw, meta)
    argmax = processed.argmax(dim=-1).tolist()
    token_ids: list[list[int]] = []
    random_rows: list[int] = []
    for i, r in enumerate(requests):
        if r.params.greedy:
            token_ids.append(greedy_accept(argmax[offsets[i]:offsets[i + 1]], r.draft_token_ids))
        else:
            token_ids.append([])
            random_rows.append(i)
    if random_rows:
        sampled = _rejection(processed, meta, requests, random_rows, offsets)
        for i, ids in zip(random_rows, sampled, strict=True):
            token_ids[i] = ids
    logprobs: list[list[TokenLogprobs] | None] = []
    rows: list[int] = []
    for r, off, ids in zip(requests, offsets, token_ids, strict=False):  # offsets: R + 1
        k = r.params.logprobs
        logprobs.append(None if k is None else compute_prompt_logprobs(
            raw[off:off + len(ids)], torch.tensor(ids, device=raw.device), k))
        rows.extend(range(off, off + len(ids)))
    flat = logprobs_of(raw[torch.tensor(rows, device=raw.device)],
                       torch.tensor([t for ids in token_ids for t in ids],
                                    device=raw.device)).tolist()
    chosen, start = [], 0
    for ids in token_ids:
        chosen.append(flat[start:start + len(ids)])
        start += len(ids)
    return VerifyResult(token_ids, logprobs, chosen)


def position_metadata(requests: list[SpecRequest], device: torch.device,
                      allowed_tokens: tuple[torch.Tensor, list[int]] | None = None,
                      ) -> SamplingMetadata:
    """Sampling metadata with one row per verified position (drafts count as output)."""
    params, prompts, outputs, stops = [], [], [], []
    for r in requests:
        for j in range(len(r.draft_token_ids) + 1):
            params.append(r.params)
            prompts.append(r.prompt_token_ids)
            outputs.append(r.output_token_ids + r.draft_token_ids[:j])
            stops.append(r.stop_token_ids)
    return SamplingMetadata.build(params=params, prompt_token_ids=prompts,
                                  output_token_ids=outputs, generators=[None] * len(params),
                                  stop_token_ids=stops, device=device,
                                  allowed_tokens=allowed_tokens)


def _rejection(processed: torch.Tensor, meta: SamplingMetadata, requests: list[SpecRequest],
               which: list[int], offsets: list[int]) -> list[list[int]]:
    """Rejection-sample the requests ``which`` (all random), padded to their longest draft."""
    weights = sampling_weights(processed, meta)
    probs = weights / weights.sum(dim=-1, keepdim=True)
    device, vocab = probs.device, probs.shape[1]
    subset = [requests[i] for i in which]
    ks = [len(r.draft_token_ids) for r in subset]
    k_max = max(ks)
    # Padding positions repeat a request's last row; rejection_sample masks them.
    index = [[offsets[i] + min(j, k) for j in range(k_max + 1)]
             for i, k in zip(which, ks, strict=True)]
    target = probs[torch.tensor(index, device=device)]
    padded = [r.draft_token_ids + [0] * (k_max - k) for r, k in zip(subset, ks, strict=True)]
    drafts = torch.tensor(padded, dtype=torch.long, device=device)
    generators = {row: r.generator for row, r in enumerate(subset) if r.generator is not None}
    uniforms, exponentials = draw_randomness(ks, vocab, generators, device)
    out, counts = rejection_sample(target, drafts, torch.tensor(ks, device=device),
                                   _draft_probs(subset, drafts, ks, vocab), uniforms, exponentials)
    return [row[:c] for row, c in zip(out.tolist(), counts.tolist(), strict=True)]


def _draft_probs(subset: list[SpecRequest], drafts: torch.Tensor, ks: list[int],
                 vocab: int) -> torch.Tensor | None:
    """``[R, K, V]`` draft distributions, point masses where a request has none; None if no
    request has one (all n-gram proposals)."""
    if all(r.draft_probs is None for r in subset):
        return None
    q = torch.zeros(len(subset), drafts.shape[1], vocab, device=drafts.device)
    for row, (r, k) in enumerate(zip(subset, ks, strict=True)):
        if r.draft_probs is None:
            q[row, torch.arange(k), drafts[row, :k]] = 1.0
        else:
            q[row, :k] = r.draft_probs[:k]
    return q
