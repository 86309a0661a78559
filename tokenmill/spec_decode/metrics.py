"""Running totals of speculative decoding, as plain data (no torch: the scheduler's stats carry
them to the loggers)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """What was proposed and accepted since the engine started.

    A "draft" is one request's proposal verified in one step; it yields ``accepted + 1`` tokens
    (the accepted drafts and the target's own next token).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose token i (0-based) was accepted.
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verified draft of ``num_draft_tokens`` tokens, ``num_accepted`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        missing = num_accepted - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position.extend([0] * missing)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per verified draft: accepted + 1 (1.0 before any draft)."""
        if not self.num_drafts:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_position))
