"""Draft-model proposals: a small model with the target's tokenizer runs K steps ahead.

"self:N" builds the draft from the target's own first N decoder layers, final norm and head,
sharing their weights (no copy, no second file), so it works with the embedded model. The draft
keeps its own paged KV cache (its own block bookkeeping and tensors, as many blocks as the
target's). Each step it rolls a request back to the tokens the target kept: the cached prefix
that still matches the request's tokens stays, the rest is recomputed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.config import SpeculativeConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.distributed import unsharded
from tokenmill.model_loader import load_model
from tokenmill.models.config import ArchConfig
from tokenmill.request import Request
from tokenmill.runner.flat_batch import FlatBatch
from tokenmill.runner.kv_memory import KVCacheShape
from tokenmill.runner.platform import Platform
from tokenmill.runner.sampler import (
    apply_logits_processors,
    exponential_race,
    sampling_weights,
)
from tokenmill.runner.sampling_metadata import SamplingMetadata
from tokenmill.runner.step_backend import EagerBackend, ModelStep
from tokenmill.spec_decode.proposer import Proposal, TargetModel

# Seeded requests' draft generators start from seed + this (mod 2**63): a stream of their own,
# not a copy of the target's.
_DRAFT_SEED_OFFSET = 0x5DEECE66D
# Catch-up chunks up to this long run as one-token sequences (a decode-only step for the fused
# stack); a longer one (the prompt, on a request's first proposal) is a prefill chunk.
_SPLIT_MAX_TOKENS = 16


def self_draft_model(target: nn.Module, num_layers: int) -> nn.Module:
    """The target's first ``num_layers`` layers, final norm, rotary tables and head as a model
    of its own class: every parameter is the target's own tensor, nothing is copied.

    Shallow copies with their own module dicts, so the target's layer list is untouched.
    """
    inner = copy.copy(target.model)
    inner._modules = dict(inner._modules)
    inner.layers = nn.ModuleList(list(target.model.layers[:num_layers]))
    draft = copy.copy(target)
    draft._modules = dict(draft._modules)
    draft.model = inner
    draft.config = dataclasses.replace(target.config, num_hidden_layers=num_layers)
    return draft


def build_draft_proposer(config: SpeculativeConfig, target: TargetModel) -> DraftModelProposer:
    """The draft model ``config`` names, next to ``target``; ValueError if unusable."""
    target_arch = target.arch
    num_layers = config.self_draft_layers
    if num_layers is not None:
        if num_layers >= target_arch.num_hidden_layers:
            raise ValueError(f"speculative_model self:{num_layers} must take fewer layers than "
                             f"the target's {target_arch.num_hidden_layers}")
        model = self_draft_model(target.model, num_layers)
        arch = dataclasses.replace(target_arch, num_hidden_layers=num_layers)
    else:
        # Whole, even in a process that also runs a tensor-parallel engine: a draft model
        # always runs on one rank.
        with unsharded():
            loaded = load_model(dataclasses.replace(target.model_config, model=config.draft_model),
                                target.platform.device, target.dtype)
        model, arch = loaded.model, loaded.arch
        if arch.vocab_size != target_arch.vocab_size:
            raise ValueError(f"speculative_model has a vocabulary of {arch.vocab_size} tokens, "
                             f"the target {target_arch.vocab_size}: they must share a tokenizer")
        if arch.max_position_embeddings < target.max_model_len:
            raise ValueError(f"speculative_model's context ({arch.max_position_embeddings}) is "
                             f"shorter than max_model_len={target.max_model_len}")
    return DraftModelProposer(model, arch, target.platform, target.dtype, target.block_size,
                              target.num_blocks, config.num_speculative_tokens)


@dataclass
class _DraftState:
    """One request's draft-side state."""

    # Token ids whose K/V the draft cache holds, from position 0: a prefix of the request's
    # tokens, then the drafts fed back in (at most K - 1 of them).
    computed: list[int]
    generator: torch.Generator | None


@dataclass
class _Job:
    """One request's proposal being built this step."""

    request: Request
    state: _DraftState
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class DraftModelProposer:
    """Runs the draft model K steps per proposal, sampling as the request asks."""

    def __init__(self, model: nn.Module, arch: ArchConfig, platform: Platform, dtype: torch.dtype,
                 block_size: int, num_blocks: int, num_speculative_tokens: int) -> None:
        self.model = model
        self.device = platform.device
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.backend = platform.attention_backend()
        self.kv = KVCacheManager(num_blocks, block_size)
        shape = KVCacheShape(arch.num_hidden_layers, block_size, arch.num_key_value_heads,
                             arch.head_dim, dtype)
        self.kv_caches = shape.allocate(num_blocks, self.device)
        # The platform's step backend for the draft model (the CPU program where it runs
        # it), model.forward for the steps it does not support.
        self.eager = EagerBackend(model)
        self.step_backend = platform.step_backend(self.eager)
        self.states: dict[str, _DraftState] = {}

    def finish(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
            self.kv.free(rid)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        jobs = [job for r in requests if (job := self._job(r)) is not None]
        if not jobs:
            return {}
        # First step: each request catches up to its last token (usually 1-2 tokens: the
        # target's own token and the last accepted draft, which the draft never computed).
        batch, rows = FlatBatch(self.block_size), []
        for job in jobs:
            state = job.state
            chunk = job.request.all_token_ids[len(state.computed):]
            rows.append(self._add(batch, job, chunk, split=len(chunk) <= _SPLIT_MAX_TOKENS))
        active = jobs
        while True:
            self._sample(self._logits(batch, rows), active)
            active = [job for job in active if len(job.token_ids) < job.num_tokens]
            if not active:
                break
            batch, rows = FlatBatch(self.block_size), []
            for job in active:
                rows.append(self._add(batch, job, job.token_ids[-1:], split=True))
        return {job.request.request_id: Proposal(
            job.token_ids, torch.stack(job.probs) if job.probs else None) for job in jobs}

    def _job(self, request: Request) -> _Job | None:
        """Roll the request's draft state back to what still matches; None when it gets no
        proposal (no room left in its length limit or in the draft's KV cache)."""
        rid = request.request_id
        tokens = request.all_token_ids
        assert request.max_total_tokens is not None
        num = min(self.num_speculative_tokens, request.max_total_tokens - len(tokens) - 1)
        if num <= 0 or self.kv.allocate_slots(rid, len(tokens) + num - 1) is None:
            return None
        state = self.states.get(rid)
        if state is None:
            params = request.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                seed = (params.seed + _DRAFT_SEED_OFFSET) % 2**63
                generator = torch.Generator(self.device).manual_seed(seed)
            state = self.states[rid] = _DraftState([], generator)
        # Only the fed-back drafts can differ from the request's tokens; the last token is
        # recomputed anyway, for its logits.
        keep = max(len(state.computed) - self.num_speculative_tokens, 0)
        limit = min(len(state.computed), len(tokens) - 1)
        while keep < limit and state.computed[keep] == tokens[keep]:
            keep += 1
        del state.computed[keep:]
        return _Job(request, state, num)

    def _add(self, batch: FlatBatch, job: _Job, token_ids: list[int], split: bool) -> int:
        """Queue a request's next tokens; returns the row whose logits come next."""
        computed = job.state.computed
        row0 = batch.add(token_ids, len(computed), self.kv.get_block_ids(job.request.request_id),
                         split=split)
        computed.extend(token_ids)
        return row0 + len(token_ids) - 1

    def _logits(self, batch: FlatBatch, rows: list[int]) -> torch.Tensor:
        input_ids, positions, meta = batch.build(self.backend, self.kv_caches, self.device)
        step = ModelStep(input_ids, positions, meta)
        backend = self.step_backend
        hidden = backend.forward(step) if backend.supports(step) else self.eager.forward(step)
        return self.model.compute_logits(
            hidden.index_select(0, torch.tensor(rows, device=self.device)))

    def _sample(self, logits: torch.Tensor, jobs: list[_Job]) -> None:
        """One draft token per job, drawn as its request samples (the drafts so far count as
        output); random requests keep the distribution they drew from."""
        meta = SamplingMetadata.build(
            params=[j.request.sampling_params for j in jobs],
            prompt_token_ids=[j.request.prompt_token_ids for j in jobs],
            output_token_ids=[j.request.output_token_ids + j.token_ids for j in jobs],
            generators=[j.state.generator for j in jobs],
            stop_token_ids=[_stop_token_ids(j.request) for j in jobs],
            device=self.device,
        )
        processed = apply_logits_processors(logits, meta)
        greedy_ids = processed.argmax(dim=-1)
        if meta.all_greedy:
            for job, token_id in zip(jobs, greedy_ids.tolist(), strict=True):
                job.token_ids.append(token_id)
            return
        weights = sampling_weights(processed, meta)
        probs = weights / weights.sum(dim=-1, keepdim=True)
        sampled = exponential_race(probs, meta.generators).tolist()
        for i, (job, greedy_id) in enumerate(zip(jobs, greedy_ids.tolist(), strict=True)):
            if job.request.sampling_params.greedy:
                job.token_ids.append(greedy_id)
            else:
                job.token_ids.append(sampled[i])
                job.probs.append(probs[i])


def _stop_token_ids(request: Request) -> list[int]:
    """The ids min_tokens holds back, as the runner computes them."""
    params = request.sampling_params
    eos = [] if params.ignore_eos else sorted(request.eos_token_ids)
    return [*params.stop_token_ids, *eos]
