"""A step's model inputs from a SchedulerOutput: the flat batch of tokens and positions with
its attention metadata, and which rows are sampled, verified (draft tokens), pooled
(embeddings) or scored (prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.runner.flat_batch import FlatBatch
from tokenmill.runner.pooling import EncoderBatch
from tokenmill.runner.request_state import RequestState

# Prompt logprobs one request computes this step: its hidden-state rows, the prompt tokens they
# score, and how many tokens before the first were skipped (reported as None).
PromptLogprobRows = tuple[RequestState, list[int], list[int], int]


@dataclass
class SpecRows:
    """The requests of a step that verify draft tokens, with their drafts and rows."""

    states: list[RequestState] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def add(self, state: RequestState, drafts: list[int], rows: range) -> None:
        self.states.append(state)
        self.drafts.append(drafts)
        self.rows.extend(rows)


@dataclass
class StepInputs:
    """One step's model inputs and which rows of the output are used for what."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_meta: AttentionMetadata
    # Rows of the hidden states to sample from, and the requests they belong to.
    sample_rows: list[int]
    sample_states: list[RequestState]
    # Requests verifying draft tokens: every position of theirs is scored.
    spec: SpecRows
    # Per request needing prompt logprobs this step (see PromptLogprobRows).
    prompt_lp_rows: list[PromptLogprobRows]
    # Embedding requests whose prompt this step computes, with their rows (start, count).
    pool_states: list[RequestState] = field(default_factory=list)
    pool_spans: list[tuple[int, int]] = field(default_factory=list)
    # Every row is sampled, in order (a decode-only step): the head takes the hidden states
    # as they are.
    samples_every_row: bool = False
    # Rows whose token is still on the device (the previous launched step's sample), and
    # the request of each: the runner fills them there before the forward pass.
    in_flight: tuple[list[int], list[str]] = field(default_factory=lambda: ([], []))


def prepare_inputs(sched: SchedulerOutput, requests: dict[str, RequestState], block_size: int,
                   backend: AttentionBackend, kv_caches: list[torch.Tensor],
                   device: torch.device, is_encoder: bool = False,
                   deterministic: bool = False) -> StepInputs:
    """The step's inputs; advances each scheduled request's ``num_computed_tokens``.

    A request whose last token the previous launched step sampled and the host has not seen
    yet (asynchronous scheduling) gets a placeholder id, and its row is listed in
    ``StepInputs.in_flight`` for the runner to fill on the device.
    """
    batch = EncoderBatch() if is_encoder else FlatBatch(block_size)
    pool_states: list[RequestState] = []
    pool_spans: list[tuple[int, int]] = []
    sample_rows: list[int] = []
    sample_states: list[RequestState] = []
    spec = SpecRows()
    prompt_lp_rows: list[PromptLogprobRows] = []
    # Rows whose token the previous launched step sampled and the host has not seen yet
    # (asynchronous scheduling), with the request each belongs to.
    in_flight: tuple[list[int], list[str]] = ([], [])
    for rid, n in sched.num_scheduled_tokens.items():
        state = requests[rid]
        start = state.num_computed_tokens
        end = start + n
        drafts = sched.scheduled_spec_decode_tokens.get(rid)
        if drafts:
            # The last token and the drafts after it; logits at each position verify them.
            row0 = batch.add(state.token_ids[start:] + drafts, start, state.block_ids,
                             split=True)
            spec.add(state, drafts, range(row0, row0 + n))
            state.num_computed_tokens = end
            continue
        # Deterministic: each token a one-token sequence, so that a prompt token is
        # computed as a decode token is, whatever the chunking and the batch mates.
        token_ids = state.token_ids[start:end]
        if end > len(state.token_ids):
            # The last token is still on the device: a placeholder, which the runner fills
            # there (StepInputs.in_flight).
            token_ids.append(0)
            in_flight[0].append(len(batch.ids) + n - 1)
            in_flight[1].append(rid)
        row0 = batch.add(token_ids, start, state.block_ids, split=deterministic)
        state.num_computed_tokens = end
        if state.pooling is not None:  # the whole prompt, in this one step
            pool_states.append(state)
            pool_spans.append((row0, n))
            continue
        if state.params.prompt_logprobs is not None:
            plan_prompt_logprobs(state, start, end, row0, prompt_lp_rows)
        if end >= len(state.token_ids):
            sample_rows.append(row0 + n - 1)
            sample_states.append(state)
    input_ids, positions, meta = batch.build(backend, kv_caches, device)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        attn_meta=meta,
        sample_rows=sample_rows,
        sample_states=sample_states,
        spec=spec,
        prompt_lp_rows=prompt_lp_rows,
        pool_states=pool_states,
        pool_spans=pool_spans,
        # Rows are sampled in increasing order, at most one a request: as many as there
        # are rows means each request has one row, the one sampled.
        samples_every_row=len(sample_rows) == input_ids.shape[0] and not spec.states,
        in_flight=in_flight,
    )


def plan_prompt_logprobs(state: RequestState, start: int, end: int, row0: int,
                         plan: list[PromptLogprobRows]) -> None:
    """Add the rows of ``state``'s prompt positions ``start .. end`` (from row ``row0``)
    whose logprobs are due to ``plan``."""
    # Position p's logits score prompt token p+1; each is reported once, even if the
    # request is preempted and its prompt recomputed. Tokens before prompt_logprobs_start
    # (some perhaps served by the prefix cache) are reported as None.
    done = state.sampling.num_prompt_logprobs_done
    first = max(start, done, state.params.prompt_logprobs_start - 1)
    last = min(end, state.num_prompt_tokens - 1)
    if first >= last:
        return
    rows = [row0 + p - start for p in range(first, last)]
    targets = state.token_ids[first + 1:last + 1]
    plan.append((state, rows, targets, first - done))
    state.sampling.num_prompt_logprobs_done = last
