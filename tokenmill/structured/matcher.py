"""Per-request grammar state and the batch's token bitmask.

A ``GrammarState`` follows a request's output tokens: the runner fills its row of the step's
bitmask before sampling (every row of the batch in one tensor), applies the bitmask to the
logits, and feeds the chosen tokens back. Its state only moves with tokens the request keeps,
so a preempted request, whose generated tokens stay, resumes with its state as it was.
Speculative decoding: the rows of a request's draft positions are filled by advancing through
the drafts and rolling back; a draft the grammar forbids gets probability 0 at its position,
so verification rejects it.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# One xgrammar batch filler per thread that fills bitmasks (an engine's step loop).
_fillers = threading.local()


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar
        self._matcher = xgrammar.GrammarMatcher(compiled)  # rolls back any number of tokens
        # Set when the grammar is complete (it accepted a stop token) or a token broke it.
        self.finished = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_drafts(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Rows ``first_row .. first_row + len(drafts)``: the tokens allowed after each prefix
        of ``drafts``. Rows after a draft the grammar refuses allow everything: verification
        stops at that draft, so they are never sampled."""
        accepted = 0
        self.fill(bitmask, first_row)
        for j, token in enumerate(drafts):
            row = first_row + j + 1
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                bitmask[row:first_row + len(drafts) + 1].fill_(-1)
                break
            accepted += 1
            self.fill(bitmask, row)
        if accepted:
            self._matcher.rollback(accepted)

    def accept(self, token_ids: list[int]) -> int:
        """Feed the request's new tokens; returns how many it keeps: all of them, or up to and
        including the token that completed the grammar (``finished`` is then set). A token the
        grammar refuses (only when every allowed token was masked by something else, e.g.
        min_tokens) ends the request before it."""
        for n, token in enumerate(token_ids):
            if not self._matcher.accept_token(token):
                logger.warning("a sampled token (%d) does not match the request's grammar; "
                               "ending the request", token)
                self.finished = True
                return n
            if self._matcher.is_terminated():
                self.finished = True
                return n + 1
        return len(token_ids)


def fill_rows(bitmask: torch.Tensor, grammars: list[GrammarState], rows: list[int]) -> None:
    """``grammars[i].fill(bitmask, rows[i])`` for every i, the rows spread over torch's
    threads (xgrammar's batch filler; the step loop waits here, so the threads are free)."""
    if len(grammars) == 1:
        grammars[0].fill(bitmask, rows[0])
        return
    if not grammars:
        return
    threads = torch.get_num_threads()
    filler = getattr(_fillers, "filler", None)
    if filler is None or _fillers.threads != threads:
        import xgrammar
        filler = _fillers.filler = xgrammar.BatchGrammarMatcher(max_threads=threads)
        _fillers.threads = threads
    filler.batch_fill_next_token_bitmask([g._matcher for g in grammars], bitmask, rows)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask of ``num_rows`` rows, every token allowed."""
    import xgrammar
    return xgrammar.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf, in place, in ``logits[r]`` by
    ``bitmask[r]`` for each r in ``rows`` (float32 logits)."""
    import xgrammar
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                         indices=rows)
