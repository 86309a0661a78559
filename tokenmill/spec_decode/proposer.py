"""The proposers' common interface, what they know of the target model, and the one the
engine's configuration asks for."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tokenmill.config import ModelConfig, SpeculativeConfig
from tokenmill.models.config import ArchConfig
from tokenmill.request import Request
from tokenmill.runner.platform import Platform


@dataclass(frozen=True)
class TargetModel:
    """The engine's target model as a proposer sees it: a draft runs beside it."""

    model: nn.Module  # a self-draft ("self:N") shares its first layers
    arch: ArchConfig
    model_config: ModelConfig  # how the target was loaded; a draft model loads the same way
    platform: Platform
    dtype: torch.dtype
    block_size: int
    num_blocks: int  # blocks of the target's KV cache: a draft model's cache gets as many
    max_model_len: int


@dataclass
class Proposal:
    """Draft tokens for one request's next step."""

    token_ids: list[int]
    # [len(token_ids), V] the distributions the tokens were drawn from, for rejection sampling;
    # None for deterministic guesses (point masses), and for greedy requests, which need none.
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Guesses each request's next tokens; the target model verifies them in one step."""

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        """Drafts for requests that decode (``num_computed_tokens + 1 == num_tokens``); a
        request without a guess is left out."""
        ...

    def finish(self, request_ids: Iterable[str]) -> None:
        """Forget requests that finished or were preempted."""
        ...


def make_proposer(config: SpeculativeConfig, target: TargetModel) -> Proposer | None:
    """The proposer ``config`` asks for, built next to ``target``; None when off."""
    if config.method == "ngram":
        from tokenmill.spec_decode.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    if config.method == "draft":
        from tokenmill.spec_decode.draft import build_draft_proposer

        return build_draft_proposer(config, target)
    return None
