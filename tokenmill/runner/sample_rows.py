"""A step's sampling: the next token of each row that samples, and the verification of the
draft tokens of each request that speculates, with the grammars' allowed tokens applied to
both."""

from __future__ import annotations

import torch

from tokenmill.core.sched_output import RunnerOutput
from tokenmill.runner.launched import HostCopy, SampledRows, sample_is_history_free
from tokenmill.runner.request_state import RequestState, advance_grammar
from tokenmill.runner.sampler import Sampler, plain_greedy
from tokenmill.runner.sampling_metadata import SamplingMetadata
from tokenmill.runner.spec_verify import SpecRequest, verify_drafts
from tokenmill.runner.step_inputs import SpecRows
from tokenmill.structured.matcher import GrammarState, allocate_bitmask, fill_rows
from tokenmill.utils import ListSlice


def sample_rows(sampler: Sampler, logits: torch.Tensor, states: list[RequestState],
                device: torch.device) -> tuple[SampledRows, torch.Tensor]:
    """Queue the sampling of ``states``' next tokens: the rows (whose host copies
    :meth:`SampledRows.finish` reads) and the sampled ids on the device (the next step's
    input when it is scheduled before these reach the host)."""
    if all(s.sampling.grammar is None and plain_greedy(s.params) for s in states) and (
            result := sampler.greedy(logits)) is not None:
        # Greedy decoding and nothing else: no metadata to build (~50 us of a ~5 ms
        # batch-1 step on a 2-core Xeon).
        return SampledRows(states, HostCopy(result.sampled_token_ids, result.chosen_logprobs),
                           None, overlappable=True), result.sampled_token_ids
    meta = SamplingMetadata.build(
        params=[s.params for s in states],
        prompt_token_ids=[ListSlice(s.token_ids, 0, s.num_prompt_tokens) for s in states],
        output_token_ids=[ListSlice(s.token_ids, s.num_prompt_tokens) for s in states],
        generators=[s.sampling.generator for s in states],
        stop_token_ids=[s.stop_ids for s in states],
        device=device,
        allowed_tokens=grammar_bitmask(states, [[]] * len(states), logits.shape[1]),
        forced_tokens=forced_tokens(states),
    )
    result = sampler(logits, meta)
    # The top logprobs are read now (a wait for this step); they are rare.
    logprobs = result.to_token_logprobs() if result.has_logprobs else None
    rows = SampledRows(states, HostCopy(result.sampled_token_ids, result.chosen_logprobs),
                       logprobs, overlappable=logprobs is None and all(
                           sample_is_history_free(s) for s in states))
    return rows, result.sampled_token_ids


def forced_tokens(states: list[RequestState]) -> dict[int, int] | None:
    """Row -> the token its spent thinking budget forces; None when no row has a budget."""
    if not any(s.sampling.thinking is not None for s in states):
        return None
    forced = {}
    for row, state in enumerate(states):
        tracker = state.sampling.thinking
        if tracker is not None and (token := tracker.forced_token(state.token_ids)) is not None:
            forced[row] = token
    return forced


def grammar_bitmask(states: list[RequestState], drafts: list[list[int]],
                    vocab_size: int) -> tuple[torch.Tensor, list[int]] | None:
    """The allowed-token bitmask of a batch whose request i has ``1 + len(drafts[i])``
    rows (one per position it samples), with the rows it constrains; None without
    grammars. Every row of a request without a grammar allows everything."""
    if not any(s.sampling.grammar is not None for s in states):
        return None
    bitmask = allocate_bitmask(sum(len(d) + 1 for d in drafts), vocab_size)
    rows: list[int] = []
    singles: tuple[list[GrammarState], list[int]] = ([], [])  # no drafts: filled together
    row = 0
    for state, ds in zip(states, drafts, strict=True):
        grammar = state.sampling.grammar
        if grammar is not None and not grammar.finished:
            if ds:
                grammar.fill_drafts(bitmask, row, ds)
            else:
                singles[0].append(grammar)
                singles[1].append(row)
            rows.extend(range(row, row + len(ds) + 1))
        row += len(ds) + 1
    fill_rows(bitmask, *singles)
    return (bitmask, rows) if rows else None


def verify_rows(logits: torch.Tensor, spec: SpecRows, draft_probs: dict[str, torch.Tensor],
                out: RunnerOutput) -> None:
    """Accept or reject each request's drafts; it emits the accepted ones plus one."""
    requests = [SpecRequest(
        params=s.params,
        prompt_token_ids=s.token_ids[:s.num_prompt_tokens],
        output_token_ids=s.token_ids[s.num_prompt_tokens:],
        draft_token_ids=drafts,
        generator=s.sampling.generator,
        stop_token_ids=s.stop_ids,
        draft_probs=draft_probs.get(s.request_id),
    ) for s, drafts in zip(spec.states, spec.drafts, strict=True)]
    allowed = grammar_bitmask(spec.states, spec.drafts, logits.shape[1])
    result = verify_drafts(logits, requests, allowed)
    for state, token_ids, logprobs, chosen in zip(spec.states, result.token_ids,
                                                  result.logprobs, result.chosen_logprobs,
                                                  strict=True):
        kept = advance_grammar(state, token_ids, out)
        state.token_ids.extend(kept)
        out.sampled_token_ids[state.request_id] = kept
        out.sampled_logprobs[state.request_id] = chosen[:len(kept)]
        if logprobs is not None:
            out.logprobs[state.request_id] = logprobs[:len(kept)]
