"""The thinking budget in the sampler: per request, how many thinking tokens it has spent, and
the token it is forced to write once the budget is spent (see ``ThinkingBudget``).

Plain Python over the request's token ids, read incrementally: each step looks only at the
tokens added since the last one. The state lives in the request's ``SamplingState``, so it
outlives a preemption (the request keeps its generated tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.sampling_params import ThinkingBudget


class ThinkingTracker:
    """One request's thinking: inside it or not, tokens spent, and the forced ending."""

    def __init__(self, budget: ThinkingBudget, num_prompt_tokens: int) -> None:
        self.budget = budget
        self.inside = budget.starts_inside
        self.spent = 0
        self._scanned = num_prompt_tokens  # the prompt's state is ``starts_inside``
        self._forcing = -1  # the index in end_token_ids of the next forced token; -1: none
        self._recent: list[int] = []  # the last tokens, to see a multi-token start marker

    def forced_token(self, token_ids: Sequence[int]) -> int | None:
        """The token the request must write next (None: whatever it samples), given all its
        token ids so far (prompt and output)."""
        b = self.budget
        for i in range(self._scanned, len(token_ids)):
            token = token_ids[i]
            if self._forcing >= 0:  # the forced token just written
                self._forcing += 1
                if self._forcing == len(b.end_token_ids):
                    self._forcing = -1
            if self.inside:
                if token == b.end_token_id:
                    self.inside = False
                else:
                    self.spent += 1
                continue
            self._recent = (self._recent + [token])[-len(b.start_token_ids):]
            self.inside = tuple(self._recent) == b.start_token_ids
        self._scanned = len(token_ids)
        if self._forcing < 0 and self.inside and self.spent >= b.max_tokens:
            self._forcing = 0
        return b.end_token_ids[self._forcing] if self._forcing >= 0 else None
