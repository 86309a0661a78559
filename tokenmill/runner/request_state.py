"""The runner's copy of a request while it holds KV blocks, and what of its sampling outlives
a preemption."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.core.sched_output import RunnerOutput
from tokenmill.lora_request import LoRARequest
from tokenmill.runner.thinking import ThinkingTracker
from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.structured.matcher import GrammarState


@dataclass
class SamplingState:
    """What outlives a preemption: the seeded generator's position, prompt logprobs sent and
    the position in the request's grammar (its generated tokens are kept, so is the state)."""

    generator: torch.Generator | None
    num_prompt_logprobs_done: int = 0
    grammar: GrammarState | None = None
    # The thinking budget's count and forced ending (None: no budget).
    thinking: ThinkingTracker | None = None


@dataclass
class RequestState:
    """The runner's copy of a request while it holds KV blocks."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingState
    stop_ids: list[int] = field(default_factory=list)
    # Set for an embedding request (pooled, never sampled).
    pooling: PoolingParams | None = None
    # The LoRA adapter its rows run with (None: the base model).
    lora: LoRARequest | None = None


def advance_grammar(state: RequestState, token_ids: list[int],
                    out: RunnerOutput) -> list[int]:
    """The new tokens the request keeps once its grammar has seen them (all of them, or up to
    the one that completed the grammar, which then ends the request)."""
    grammar = state.sampling.grammar
    if grammar is None:
        return token_ids
    kept = token_ids[:grammar.accept(token_ids)]
    if grammar.finished:
        out.grammar_finished.add(state.request_id)
    return kept
