"""The proposers' common interface, and the one the engine's configuration asks for."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tokenmill.config import SpeculativeConfig
from tokenmill.request import Request

if TYPE_CHECKING:
    import torch

    from tokenmill.engine.core import EngineCore


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


def make_proposer(config: SpeculativeConfig, core: EngineCore) -> Proposer | None:
    """The proposer ``config`` asks for, built next to ``core``'s model; None when off."""
    if config.method == "ngram":
        from tokenmill.spec_decode.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    if config.method == "draft":
        from tokenmill.spec_decode.draft import build_draft_proposer

        return build_draft_proposer(config, core)
    return None
