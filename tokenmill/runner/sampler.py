"""The runner's sampler: penalties, logit bias, top-k/top-p/min-p, per-request seeds, logprobs.

It reads a step's rows through one `SamplingMetadata` (sampling_metadata.py), which holds
tensors only for the features some row uses; a plain greedy step needs none (`Sampler.greedy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from tokenmill.kernels.cpu import extension_if_loaded
from tokenmill.outputs import TokenLogprobs
from tokenmill.runner.sampling_metadata import SamplingMetadata
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.matcher import apply_bitmask
from tokenmill.utils import triton_module

# Floor for the exponential draws: exponential_() can return exactly 0, and p / 0 would pick a
# token of probability 0 (or give NaN).
_MIN_EXPONENTIAL = 1e-20


@dataclass
class SamplerOutput:
    """Sampled tokens, plus logprobs (of the raw logits) when some row asked for them."""

    sampled_token_ids: torch.Tensor  # [B] long
    sampled_logprobs: torch.Tensor | None = None  # [B] float
    sampled_ranks: torch.Tensor | None = None  # [B] long, 1 = most likely
    topk_token_ids: torch.Tensor | None = None  # [B, k] long, most likely first
    topk_logprobs: torch.Tensor | None = None  # [B, k] float
    # [B] float, the raw logprob of each sampled token, for every row (the quality monitor's
    # mean output logprob); None when the Sampler was made with chosen_logprobs=False.
    chosen_logprobs: torch.Tensor | None = None

    @property
    def has_logprobs(self) -> bool:
        """True when logprobs were computed for this batch."""
        return self.sampled_logprobs is not None

    def to_token_logprobs(self) -> list[TokenLogprobs]:
        """One TokenLogprobs per row (every row gets the batch's max k alternatives)."""
        if self.sampled_logprobs is None:
            raise ValueError("this SamplerOutput has no logprobs: no row asked for them")
        assert self.sampled_ranks is not None and self.topk_token_ids is not None
        assert self.topk_logprobs is not None
        return _to_token_logprobs(self.sampled_token_ids, self.sampled_logprobs,
                                  self.sampled_ranks, self.topk_token_ids, self.topk_logprobs)


def _to_token_logprobs(ids: torch.Tensor, lps: torch.Tensor, ranks: torch.Tensor,
                       top_ids: torch.Tensor, top_lps: torch.Tensor) -> list[TokenLogprobs]:
    # One device->host copy per tensor instead of one per element.
    rows = zip(ids.tolist(), lps.tolist(), ranks.tolist(), top_ids.tolist(), top_lps.tolist(),
               strict=True)
    return [TokenLogprobs(t, lp, r, dict(zip(ti, tl, strict=True))) for t, lp, r, ti, tl in rows]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For log-probabilities [N, V] and chosen ids [N]: the chosen logprob [N], its rank [N]
    (1 + the number of strictly more likely tokens), and the top-k ids and logprobs [N, k]."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    if k == 0:
        empty_ids = torch.empty(logprobs.shape[0], 0, dtype=torch.long, device=logprobs.device)
        return chosen.squeeze(1), ranks, empty_ids, logprobs.new_empty(logprobs.shape[0], 0)
    top_lps, top_ids = logprobs.topk(k, dim=1)
    # Equal logprobs (common with bf16 logits) in ascending id order, as argmax breaks ties, so
    # that a greedy token is listed first among the top ones.
    by_id = top_ids.argsort(dim=1)
    top_ids, top_lps = top_ids.gather(1, by_id), top_lps.gather(1, by_id)
    by_lp = top_lps.argsort(dim=1, descending=True, stable=True)
    return chosen.squeeze(1), ranks, top_ids.gather(1, by_lp), top_lps.gather(1, by_lp)


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The log-probability [N] of ``token_ids`` [N] under raw ``logits`` [N, V] (float32):
    one logsumexp per row, without materialising the whole log-softmax."""
    return logits.gather(1, token_ids.view(-1, 1)).squeeze(1) - torch.logsumexp(logits, dim=-1)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            k: int) -> list[TokenLogprobs]:
    """Logprob and rank of each actual next prompt token plus the top-k, from raw logits [P, V]
    (row p scores ``target_ids[p]``)."""
    if logits.shape[0] != target_ids.shape[0]:
        raise ValueError(f"logits has {logits.shape[0]} rows but target_ids has "
                         f"{target_ids.shape[0]} ids")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    lps, ranks, top_ids, top_lps = gather_logprobs(logprobs, target_ids, k)
    return _to_token_logprobs(target_ids, lps, ranks, top_ids, top_lps)


class Sampler:
    """Turns a step's logits [B, V] into one token id per row (see `SamplingMetadata`).

    Order: logit_bias, min_tokens, repetition penalty (prompt + output tokens), frequency and
    presence penalties (output tokens), then argmax for greedy rows and temperature, top-k,
    top-p, min-p and a draw for the others. Logprobs come from the raw logits.

    ``chosen_logprobs``: also give every row's sampled-token logprob (one logsumexp over the
    logits, well under 1% of a decode step: see the README's monitoring section).
    """

    def __init__(self, chosen_logprobs: bool = True) -> None:
        self.chosen_logprobs = chosen_logprobs

    def greedy(self, logits: torch.Tensor) -> SamplerOutput | None:
        """The common decode step, every row :func:`plain_greedy`: the argmax and its logprob
        in one pass of a kernel (C++ on the CPU, Triton on CUDA), with no SamplingMetadata to
        build. None where no such kernel applies (then ``__call__``)."""
        if not self.chosen_logprobs or (fast := _greedy_kernel(logits)) is None:
            return None
        ids, chosen = fast
        return SamplerOutput(sampled_token_ids=ids, chosen_logprobs=chosen)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row; the input logits are not modified."""
        raw = logits = logits.float()
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_logits_processors(logits, meta)
        if (meta.all_greedy and raw_logprobs is None and logits is raw
                and (fast := self.greedy(raw)) is not None):
            return fast

        greedy_ids = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy_ids
        else:
            random_ids = _sample_random(logits, meta)
            sampled = random_ids if greedy_ids is None else torch.where(
                meta.greedy_mask, greedy_ids, random_ids)  # type: ignore[arg-type]
        assert sampled is not None
        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            assert meta.max_num_logprobs is not None
            (out.sampled_logprobs, out.sampled_ranks, out.topk_token_ids,
             out.topk_logprobs) = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
            out.chosen_logprobs = out.sampled_logprobs
        elif self.chosen_logprobs:
            out.chosen_logprobs = logprobs_of(raw, sampled)
        return out


def needs_no_history(params: SamplingParams) -> bool:
    """Whether the row's logits are processed without its tokens so far: no min_tokens count,
    no penalties over its prompt or outputs and no thinking budget."""
    return (params.min_tokens == 0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
            and params.thinking_budget is None)


def plain_greedy(params: SamplingParams) -> bool:
    """Whether a row's token is the argmax of its raw logits with nothing else asked of the
    sampler: no logprobs, logit_bias, min_tokens or penalties (:meth:`Sampler.greedy`). A
    structured output's grammar is the caller's to check."""
    return (params.greedy and params.logprobs is None and not params.logit_bias
            and needs_no_history(params))


def _cuda_greedy_kernels(logits: torch.Tensor) -> ModuleType | None:
    """:mod:`tokenmill.kernels.triton.greedy` for CUDA logits when Triton is installed, else
    None (imported on first use, so a CPU run never imports Triton)."""
    return triton_module("tokenmill.kernels.triton.greedy") if logits.is_cuda else None


def _greedy_kernel(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """argmax and its logprob per row in one pass: by the Triton kernel for CUDA logits, read
    in their own dtype (no fp32 copy); by the C++ extension, when loaded, for CPU logits as a
    contiguous float32 matrix. None otherwise (PyTorch's ops then)."""
    if logits.dim() != 2:
        return None
    if (kernels := _cuda_greedy_kernels(logits)) is not None:
        if logits.dtype not in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return kernels.greedy_with_logprobs(logits if logits.stride(1) == 1
                                            else logits.contiguous())
    if logits.device.type != "cpu" or (ext := extension_if_loaded()) is None:
        return None
    logits = logits.float()
    return ext.greedy_with_logprobs(logits) if logits.is_contiguous() else None


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logit_bias, min_tokens, the penalties, the structured outputs' bitmask and the thinking
    budget's forced tokens, out of place."""
    if meta.logit_bias is not None:
        rows, ids, vals = meta.logit_bias
        logits = logits.index_put((rows, ids), vals, accumulate=True)
    if meta.min_tokens_mask is not None:
        rows, ids = meta.min_tokens_mask
        logits = logits.index_put((rows, ids), logits.new_tensor(float("-inf")))
    if not meta.no_penalties:
        logits = _apply_penalties(logits, meta)
    if meta.allowed_tokens is not None:
        bitmask, rows = meta.allowed_tokens
        logits = logits.clone()
        _mask_disallowed(logits, bitmask, rows)
    if meta.forced_tokens is not None:
        # A spent thinking budget: the row can only write its forced token.
        rows, ids = meta.forced_tokens
        logits = logits.index_fill(0, rows, float("-inf"))
        logits = logits.index_put((rows, ids), logits.new_zeros(()))
    return logits


def _mask_disallowed(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The bitmask applied in place: on the CPU by the C++ extension when the runner has it
    loaded (several times faster than xgrammar's CPU routine), else by xgrammar."""
    ext = extension_if_loaded() if logits.device.type == "cpu" else None
    if ext is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        ext.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
    else:
        apply_bitmask(logits, bitmask, rows)


def _token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] padded (-1) token ids -> [B, V] occurrence counts, with one scatter_add."""
    b = tokens.shape[0]
    counts = torch.zeros(b, vocab_size + 1, dtype=torch.float32, device=tokens.device)
    idx = torch.where(tokens < 0, vocab_size, tokens)  # padding lands in a spare column
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab_size]


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    assert meta.output_tokens is not None and meta.repetition_penalties is not None
    assert meta.frequency_penalties is not None and meta.presence_penalties is not None
    v = logits.shape[1]
    counts = _token_counts(meta.output_tokens, v)
    if meta.prompt_tokens is not None:
        seen = (counts > 0) | (_token_counts(meta.prompt_tokens, v) > 0)
        rep = meta.repetition_penalties.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits = logits - meta.frequency_penalties.unsqueeze(1) * counts
    return logits - meta.presence_penalties.unsqueeze(1) * (counts > 0).float()


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then an exponential race (Gumbel-max) per row."""
    return exponential_race(sampling_weights(logits, meta), meta.generators)


def sampling_weights(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """What a random row draws from, up to normalization: temperature, top-k, top-p, then
    min-p, of logits that went through :func:`apply_logits_processors`. Speculative decoding
    verifies draft tokens against these (normalized)."""
    assert meta.temperature is not None
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.top_p is not None:
        logits = _top_k_top_p_sorted(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        logits = _top_k(logits, meta.top_k, meta.max_top_k)
    probs = torch.softmax(logits, dim=-1)
    if meta.min_p is not None:
        floor = meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's k largest logits (k = 0: all) with one torch.topk, no full sort."""
    # Rows without top-k look at k=1 (cheap) and then keep everything via a -inf threshold.
    k = torch.where(top_k > 0, top_k.clamp(max=logits.shape[1]), 1)
    values = logits.topk(min(max_top_k, logits.shape[1]), dim=1).values
    threshold = values.gather(1, (k - 1).unsqueeze(1))
    threshold = threshold.masked_fill((top_k <= 0).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None,
                        top_p: torch.Tensor) -> torch.Tensor:
    """top-k then top-p with one ascending sort (top-p needs the sorted cumulative mass)."""
    v = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=v), v)
        kth = sorted_logits.gather(1, (v - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose mass is <= 1 - p; the most likely token always stays.
    drop = cum <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(p / q), q ~ Exp(1): a draw from p. A seeded row's q comes only from its own
    generator, so its token does not depend on its batch mates or its row index."""
    b, v = probs.shape
    q = torch.empty_like(probs)
    if len(generators) < b:
        q.exponential_()  # one batched draw for the unseeded rows (seeded rows overwritten)
    for i, gen in generators.items():
        q[i].exponential_(generator=gen)
    return (probs / q.clamp_min_(_MIN_EXPONENTIAL)).argmax(dim=-1)
