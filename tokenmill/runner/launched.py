"""A step queued on the device and not waited for yet (asynchronous scheduling): its sampled
tokens on their way to the host, and how they reach the runner's requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.sched_output import RunnerOutput
from tokenmill.outputs import TokenLogprobs
from tokenmill.runner.request_state import RequestState, advance_grammar
from tokenmill.runner.sampler import needs_no_history


class HostCopy:
    """Device tensors on their way to the host: copies queued behind the step that makes them
    (into pinned memory, with an event, on CUDA), so that launching the next step need not
    wait for them."""

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        self.event: torch.cuda.Event | None = None
        first = next((t for t in tensors if t is not None), None)
        if first is None or first.device.type != "cuda":
            self.tensors = tensors
            return
        self.tensors = tuple(None if t is None else torch.empty(t.shape, dtype=t.dtype,
                                                                pin_memory=True).copy_(
                                                                    t, non_blocking=True)
                             for t in tensors)
        self.event = torch.cuda.Event()
        self.event.record()

    def lists(self) -> list[list | None]:
        """The tensors as lists, once the copies are done."""
        if self.event is not None:
            self.event.synchronize()
        return [None if t is None else t.tolist() for t in self.tensors]


def sample_is_history_free(state: RequestState) -> bool:
    """Whether sampling the request's next token needs nothing of its tokens so far but what
    the device has: no penalties over its outputs, no min_tokens count, no grammar state. Only
    then can the next step be scheduled while this token is still on the device."""
    return state.sampling.grammar is None and needs_no_history(state.params)


@dataclass
class SampledRows:
    """One step's sampled rows, their tokens still on the device (or on their way)."""

    states: list[RequestState]
    copy: HostCopy  # the sampled ids and, when computed, their raw logprobs
    logprobs: list[TokenLogprobs] | None  # top logprobs, when some row asked
    overlappable: bool

    def finish(self, out: RunnerOutput) -> None:
        """Wait for the tokens; append them to the requests (through their grammars)."""
        sampled, chosen = self.copy.lists()
        assert sampled is not None
        logprobs = self.logprobs
        for i, (state, token_id) in enumerate(zip(self.states, sampled, strict=True)):
            kept = advance_grammar(state, [token_id], out)
            state.token_ids.extend(kept)
            out.sampled_token_ids[state.request_id] = kept
            if chosen is not None and kept:
                out.sampled_logprobs[state.request_id] = [chosen[i]]
            if logprobs is not None and state.params.logprobs is not None and kept:
                out.logprobs[state.request_id] = [trim_logprobs(logprobs[i], state.params.logprobs)]


@dataclass
class LaunchedStep:
    """A step queued on the device (:meth:`ModelRunner.launch`); :meth:`finish` waits for it.

    ``overlappable``: the next step may be scheduled and launched before this one finishes
    (its requests' next tokens need nothing the host learns from this step's tokens).
    """

    out: RunnerOutput
    sampled: SampledRows | None = None
    overlappable: bool = True

    @property
    def can_overlap(self) -> bool:
        return self.overlappable and (self.sampled is None or self.sampled.overlappable)

    def finish(self) -> RunnerOutput:
        """The step's output, its sampled tokens appended to the runner's requests."""
        if self.sampled is not None:
            self.sampled.finish(self.out)
            self.sampled = None
        return self.out


def trim_logprobs(lp: TokenLogprobs, k: int) -> TokenLogprobs:
    """Keep only the top ``k`` alternatives a request asked for (the batch computed the max)."""
    top = dict(list(lp.top.items())[:k])
    return TokenLogprobs(lp.token_id, lp.logprob, lp.rank, top)
