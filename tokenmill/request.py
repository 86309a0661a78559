"""The engine's view of one sequence being generated."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import ComputeUsage
from tokenmill.sampling_params import PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life. The FINISHED_* states carry the finish reason."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's name for how the request ended: "stop", "length", "abort" or None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def first_invalid_token_id(token_ids: Sequence[object], vocab_size: int) -> int | None:
    """The index of the first entry that is not a token id in [0, vocab_size); None if all are.

    A bool is not a token id, although Python counts it as an int. The engine and the API each
    word the error their own way (their callers see different messages)."""
    for i, tid in enumerate(token_ids):
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
            return i
    return None


class ContextOverflow(enum.Enum):
    """How a prompt and the tokens asked for do not fit in the model's context."""

    PROMPT = enum.auto()  # the prompt alone leaves no room for one generated token
    TOTAL = enum.auto()  # the prompt plus max_tokens is longer than the context


def context_overflow(prompt_len: int, max_tokens: int | None,
                     max_model_len: int) -> ContextOverflow | None:
    """Whether a prompt of ``prompt_len`` tokens, plus ``max_tokens`` to generate (None: no
    limit of its own), fits in ``max_model_len`` tokens; None when it does."""
    if prompt_len >= max_model_len:
        return ContextOverflow.PROMPT
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        return ContextOverflow.TOTAL
    return None


@dataclass(frozen=True)
class BeamSpec:
    """A beam search's settings, shared by its beams (see tokenmill/core/beam_search.py)."""

    # The request ids its n outputs carry, as the output processor knows them; the first is
    # the root request's.
    output_ids: tuple[str, ...]
    length_penalty: float
    early_stopping: bool | str
    # Tokens that end a hypothesis (eos ids unless ignore_eos, and stop_token_ids); those of
    # stop_token_ids are the stop_reason of the hypotheses they end.
    ending_ids: frozenset[int]
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    # Top alternatives to give with each output token (SamplingParams.logprobs), or None.
    logprobs: int | None = None

    @property
    def beam_width(self) -> int:
        return len(self.output_ids)


@dataclass
class Request:
    """One sequence: its prompt, the tokens generated so far and how much of it is in the KV cache.

    The scheduler's token-budget model: ``num_computed_tokens`` catches up with ``num_tokens``.
    A request whose prompt is being prefilled, one that decodes and one resumed after preemption
    differ only in how far behind ``num_computed_tokens`` is.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Ids that end generation (the tokenizer's eos ids), unless sampling_params.ignore_eos.
    eos_token_ids: frozenset[int] = frozenset()
    # Generation stops at this many tokens in total (prompt + output).
    max_total_tokens: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Another sample of the same prompt (n > 1): once that request's prompt is in the KV cache,
    # this one starts from its blocks (copy-on-write) instead of computing the prompt again.
    fork_of: str | None = None
    # The compiled grammar of sampling_params.structured_outputs (an xgrammar
    # CompiledGrammar; the scheduler only passes it on to the runner).
    grammar: object | None = None
    # An embedding request: its whole prompt is computed in one step, and it finishes with the
    # pooled vector instead of a token (sampling_params then only fill the shape).
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # Set on every beam of a beam search (SamplingParams.use_beam_search): how its group
    # ranks and ends its beams (the scheduler keeps the group's state).
    beam: BeamSpec | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # With asynchronous scheduling (a pipelined scheduler), the tokens that scheduled steps
    # sample for it and the scheduler has not appended yet: 1 from a step's schedule to its
    # update, 2 while the next step is scheduled before that update (its input is the sample
    # still on the device). Counted as tokens of the sequence when scheduling; always 0
    # otherwise.
    num_pending_tokens: int = 0
    # Draft tokens proposed for the next step (speculative decoding); not part of the sequence
    # until the target model has verified them.
    spec_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # Prompt tokens whose KV came from the prefix cache when the request was first admitted
    # (None until then; a recompute after preemption does not change it).
    num_cached_tokens: int | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Its shares of the steps that computed its tokens.
    usage: ComputeUsage = field(default_factory=ComputeUsage)
    # The sum of its output tokens' raw logprobs; None once a token came without one.
    cumulative_logprob: float | None = 0.0

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        max_tokens = self.sampling_params.max_tokens
        limit = self.max_total_tokens
        if max_tokens is not None:
            own = self.num_prompt_tokens + max_tokens
            limit = own if limit is None else min(limit, own)
        self.max_total_tokens = limit

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The finished status the newest token puts this request in, or None to go on."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.max_total_tokens is not None and self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
