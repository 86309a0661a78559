"""The plain data that crosses between scheduler and model runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import ComputeUsage, TokenLogprobs
from tokenmill.sampling_params import PoolingParams, SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption."""

    request_id: str
    # Every token the request has so far (prompt, plus outputs when resumed after preemption).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    # Tokens already in the KV cache before this step.
    num_computed_tokens: int
    # The compiled grammar its output must match (an xgrammar CompiledGrammar), or None.
    # Only rank 0's runner gets it: it does not pickle, and only rank 0's samples count.
    grammar: object | None = None
    # Set for an embedding request: the runner pools its prompt's states instead of sampling.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None


@dataclass
class CachedRequestData:
    """A request the runner already holds: what changed since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # The whole block list, when a block in it was swapped for a copy (copy-on-write); then
    # new_block_ids is empty.
    block_ids: list[int] | None = None


@dataclass
class SchedulerOutput:
    """What one engine step computes; requests appear in the batch in the order listed."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Order of the batch: new-token counts per request, new and cached requests together.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Draft tokens to verify, per request decoding speculatively: its count in
    # num_scheduled_tokens is 1 + len(drafts), the drafts following its last token.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests that left the batch since the last step; the runner drops their state.
    finished_request_ids: set[str] = field(default_factory=set)
    # Requests preempted since the last step; the runner drops their cached layout but keeps
    # their sampling state (seeded generators), which their resumption continues.
    preempted_request_ids: set[str] = field(default_factory=set)
    # (source, destination) KV blocks to copy, in every layer, before the forward pass.
    kv_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class RunnerOutput:
    """What the runner computed for one SchedulerOutput."""

    # New tokens per request; empty for a request whose prompt is still being prefilled. A
    # request that verified draft tokens gets the accepted ones plus one more (1 to K + 1).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request, per new token: (logprob of the sampled token, its rank, {token id: logprob}
    # of the top alternatives). Only for requests that asked for logprobs.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per request, per new token: the raw logprob of the sampled token (every request; empty
    # when the sampler does not compute them). The quality monitor averages them.
    sampled_logprobs: dict[str, list[float]] = field(default_factory=dict)
    # Per request, per prompt position computed this step (excluding the first prompt token);
    # None for the positions before SamplingParams.prompt_logprobs_start that were skipped.
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # Requests whose grammar is complete with this step's tokens: they finish with "stop".
    grammar_finished: set[str] = field(default_factory=set)
    # The embedding of each embedding request whose prompt this step computed.
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """One request's news from one step: new tokens, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    # When the request was first scheduled (time.monotonic()), for queue-time metrics.
    first_scheduled_time: float | None = None
    # Prompt tokens served from the prefix cache at the request's first admission.
    num_cached_tokens: int | None = None
    # The request's compute, energy and cost so far (a snapshot).
    usage: ComputeUsage | None = None
    # An embedding request's vector (it then finishes with "stop" and no tokens).
    pooled: list[float] | None = None
    # The sum of its output tokens' logprobs so far; None when some token had none.
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
