"""What the scheduler checks when a request arrives, and how a waiting request's prompt gets
its KV blocks when it is admitted: from the prefix cache and its own compute, or shared from
the first sample of the same prompt (n > 1)."""

from __future__ import annotations

from enum import Enum

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.request import ContextOverflow, Request, RequestStatus, context_overflow


def token_limit(request: Request, config: SchedulerConfig, kv: KVCacheManager,
                max_model_len: int) -> int:
    """The most tokens (prompt and output) ``request`` may reach here; ValueError when it
    could never run."""
    n = request.num_prompt_tokens
    if n == 0:
        raise ValueError("the prompt must contain at least one token")
    if request.pooling_params is not None:
        limit = _pooling_limit(n, config, max_model_len)
    elif context_overflow(n, None, max_model_len) is ContextOverflow.PROMPT:
        raise ValueError(
            f"the prompt has {n} tokens, but max_model_len is {max_model_len}: "
            "it must leave room for at least one generated token")
    else:
        limit = max_model_len
        if request.max_total_tokens is not None:
            limit = min(limit, request.max_total_tokens)
        if not config.enable_chunked_prefill:
            limit = _one_step_limit(n, limit, config.max_num_batched_tokens)
    if not kv.can_ever_fit(limit):
        raise ValueError(
            f"the request needs up to {limit} tokens of KV cache but the whole cache holds "
            f"{kv.max_num_tokens}; lower max_tokens or give the KV cache more memory")
    if request.beam is not None:
        _check_beam_search(request.beam.beam_width, limit, config, kv)
    return limit


def _pooling_limit(n: int, config: SchedulerConfig, max_model_len: int) -> int:
    """The token limit of an embedding request of ``n`` prompt tokens (all of them: it
    generates nothing); ValueError when it cannot be computed in one step."""
    if n > max_model_len:
        raise ValueError(f"the input has {n} tokens, more than max_model_len {max_model_len}")
    budget = config.max_num_batched_tokens
    if n > budget:
        raise ValueError(f"the input has {n} tokens, more than max_num_batched_tokens "
                         f"{budget}: an embedding is computed in one step")
    return n


def _one_step_limit(n: int, limit: int, budget: int) -> int:
    """The token limit without chunked prefill: a prompt, and after a preemption its prompt and
    output, is computed in one step, so it must fit the step's budget (else it would wait
    forever); ValueError when the prompt leaves no room for a generated token."""
    if n >= budget:
        raise ValueError(f"the prompt has {n} tokens, but without chunked prefill a prompt must "
                         f"fit in one step of max_num_batched_tokens {budget} with room for "
                         "one generated token")
    return min(limit, budget)


def _check_beam_search(beam_width: int, limit: int, config: SchedulerConfig,
                       kv: KVCacheManager) -> None:
    """ValueError when ``beam_width`` beams of up to ``limit`` tokens could never all be in
    the batch and the cache at once."""
    if beam_width > config.max_num_seqs:
        raise ValueError(f"n (the beam width) is {beam_width}, more than max_num_seqs "
                         f"{config.max_num_seqs}: every beam runs in each step")
    if not kv.can_ever_fit(beam_width * limit):
        raise ValueError(
            f"n (the beam width) is {beam_width}: {beam_width} beams of up to {limit} tokens "
            f"need more KV cache than the whole cache holds ({kv.max_num_tokens} tokens); "
            "lower n or max_tokens")


class PromptSource(Enum):
    """Where a waiting request's prompt KV comes from when it is admitted."""

    # Computed by the request itself, after any prefix-cache hit.
    COMPUTE = "compute"
    # Shared from its leader, a running sample of the same prompt that has computed it.
    SHARE_LEADER = "share_leader"
    # Its leader is still computing the prompt: the request waits, letting others pass.
    WAIT_FOR_LEADER = "wait_for_leader"


def prompt_source(request: Request, requests: dict[str, Request]) -> PromptSource:
    """Whether ``request`` shares a running leader's prompt blocks now, waits for them, or
    computes its prompt itself (not a later sample, resumed with outputs, or no leader)."""
    if request.fork_of is None or request.num_output_tokens:
        return PromptSource.COMPUTE
    leader = requests.get(request.fork_of)
    if leader is None or leader.status != RequestStatus.RUNNING:
        return PromptSource.COMPUTE
    # An output token means the step that computed the prompt has run: its KV is written.
    if leader.num_output_tokens:
        return PromptSource.SHARE_LEADER
    return PromptSource.WAIT_FOR_LEADER


def fork_prompt(request: Request, kv: KVCacheManager, out: SchedulerOutput) -> int | None:
    """Share the leader's prompt blocks and recompute only the last prompt token (for this
    sample's own first token); that token's write copies the block it lands in (the copy
    goes to ``out``; the request's NewRequestData carries its whole block list). Returns the
    tokens to compute, None when the blocks are not there."""
    assert request.fork_of is not None  # prompt_source said SHARE_LEADER
    n = request.num_prompt_tokens
    kv.fork(request.fork_of, request.request_id, n)
    allocation = kv.allocate_slots(request.request_id, n, n - 1)
    if allocation is None:
        kv.free(request.request_id)
        return None
    out.kv_copies.extend(allocation.copies)
    request.num_computed_tokens = n - 1
    return 1


def start_prompt(request: Request, kv: KVCacheManager, config: SchedulerConfig,
                 budget: int) -> int | None:
    """Blocks for a request's first chunk after its cached prefix: the tokens it computes,
    or None if it cannot start."""
    rid = request.request_id
    params = request.sampling_params
    # Prompt logprobs are computed in the prefill: the cache may serve only the tokens
    # before the first one whose logprob is wanted (whose logits score that one).
    tokens = request.all_token_ids
    if params.prompt_logprobs is not None:
        tokens = tokens[:params.prompt_logprobs_start]
    # An embedding pools the states of every prompt token, so none may come from the
    # cache, and it is computed whole in one step (an encoder attends both ways; a
    # decoder's mean pooling would otherwise need the states of earlier chunks).
    pooling = request.pooling_params is not None
    use_cache = not pooling and (params.prompt_logprobs is None
                                 or params.prompt_logprobs_start > 1)
    cached = kv.find_cached_prefix(rid, tokens) if use_cache else []
    num_cached = len(cached) * kv.block_size
    remaining = request.num_tokens - num_cached
    num_new = min(remaining, budget)
    if num_new < remaining and (pooling or not config.enable_chunked_prefill):
        return None
    if kv.allocate_new(rid, cached, num_cached + num_new,
                       request.num_prompt_tokens if use_cache else None) is None:
        return None
    request.num_computed_tokens = num_cached
    if request.num_cached_tokens is None:
        request.num_cached_tokens = num_cached
    return num_new
