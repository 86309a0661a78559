"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step grants every running request, oldest first, the tokens it is behind by (a prompt
chunk, or one token to decode), then admits waiting requests while the budget,
``max_num_seqs`` and the KV blocks allow. With ``prefill_first`` (the default), prompts that
fit in one step's budget go before the decodes: running requests still in such a prompt, then
waiting requests with such a prompt, take the budget first, and the decodes (and chunks of
longer prompts) share what is left. A burst of arrivals is then prefilled in a few steps while
the streams already decoding wait once, instead of every decode step of the burst carrying a
prompt chunk (many slow inter-token gaps); a prompt longer than the budget is chunked beside
the decodes, so it never holds them for its whole length. Without ``prefill_first`` every step
carries the decodes first.

When a running request needs a block and none is free, the newest running request not yet
scheduled this step is preempted: its blocks are freed and it waits to be recomputed from its
prompt and the tokens it had generated.

A request admitted starts from the longest prefix of its tokens found in the prefix cache; a
sample of an n > 1 request (``Request.fork_of``) waits until the first sample's prompt is
computed and then shares its blocks (copy-on-write).

A beam search (``Request.beam``) runs its live beams as requests; once all of them have run a
step, its group (core/beam_search.py) replaces them with the chosen continuations, new
requests on their parents' blocks. A beam that has run waits for the rest of its group; when
a waiting request cannot start for want of blocks or batch places, such beams give theirs up.

An embedding request (``Request.pooling_params``) is admitted only when its whole prompt fits
in the step's budget (never chunked, never served from the prefix cache: every token's state
is pooled) and finishes in the ``update`` of that step, with the runner's pooled vector.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from tokenmill.config import SchedulerConfig
from tokenmill.core.admission import (
    PromptSource,
    fork_prompt,
    prompt_source,
    start_prompt,
    token_limit,
)
from tokenmill.core.beam_search import BeamSearches
from tokenmill.core.kv_cache import KVCacheManager, SlotAllocation
from tokenmill.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
)
from tokenmill.metrics.stats import SchedulerStats
from tokenmill.request import Request, RequestStatus


class Scheduler:
    """Decides who runs each step and turns the runner's tokens into per-request outputs."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 pipelined: bool = False, max_loras: int = 0) -> None:
        """``pipelined``: the engine schedules a step before the last one's tokens are
        appended (asynchronous scheduling); a request's sampled token counts from the step
        that samples it (``Request.num_pending_tokens``). ``max_loras``: how many LoRA
        adapters one step may run (the runner's slots); a request whose adapter would be one
        more waits for a later step."""
        self.config = config
        self.max_loras = max_loras
        # The adapters (lora_int_id) of the step being scheduled, and how many unfinished
        # requests each adapter has.
        self._step_loras: set[int] = set()
        self._lora_live: dict[int, int] = {}
        self.pipelined = pipelined
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        self.beams = BeamSearches(self)

    # ----------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError when it could never run here."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.lora_request is not None and not self.max_loras:
            raise ValueError("this engine runs no LoRA adapters (start it with enable_lora)")
        request.max_total_tokens = token_limit(request, self.config, self.kv,
                                               self.max_model_len)
        self.register(request)
        self._enqueue(request)
        if request.beam is not None:
            self.beams.start(request)

    def register(self, request: Request) -> None:
        """Know a request (new, or a beam search's new beam) by its id."""
        rid = request.request_id
        if request.lora_request is not None:
            lora_id = request.lora_request.lora_int_id
            self.kv.set_salt(rid, request.lora_request.cache_salt, lora_id)
            self._lora_live[lora_id] = self._lora_live.get(lora_id, 0) + 1
        self.requests[rid] = request

    def finish_requests(self, request_ids: list[str] | set[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, or a stop string seen by the detokenizer)."""
        for rid in request_ids:
            if self.beams.abort(rid, status):
                continue
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self.finish(request, status)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_total=self.kv.prefix_stats.queries,
            prefix_cache_hits_total=self.kv.prefix_stats.hits,
            running_loras=_lora_names(self.running) if self.max_loras else (),
            waiting_loras=_lora_names(self.waiting) if self.max_loras else (),
            max_loras=self.max_loras,
        )

    # ------------------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and how many tokens each computes."""
        out = SchedulerOutput(
            finished_request_ids=self._finished_ids, preempted_request_ids=self._preempted_ids)
        self._finished_ids, self._preempted_ids = set(), set()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        self._step_loras = set()
        self._preempt_for_priority()
        if self.config.prefill_first:
            budget = self._schedule_running(out, scheduled, budget, short_prompts_only=True)
            # After a preemption the cache is full: admitting more would only preempt again.
            if not self._preempted_ids:
                budget = self._admit_waiting(out, scheduled, budget, short_prompts_only=True)
        budget = self._schedule_running(out, scheduled, budget)
        if not self._preempted_ids:
            budget = self._admit_waiting(out, scheduled, budget)

        if self._step_loras:
            # Each adapter's rows next to each other: one pair of products per adapter and
            # projection (the order within the base model's rows and an adapter's is kept).
            scheduled.sort(key=lambda item: 0 if item[0].lora_request is None
                           else item[0].lora_request.lora_int_id)
        now = time.monotonic()
        for request, num_new in scheduled:
            out.num_scheduled_tokens[request.request_id] = num_new
            request.num_computed_tokens += num_new
            if (self.pipelined and request.pooling_params is None
                    and request.num_computed_tokens >= request.num_tokens + request.num_pending_tokens):
                request.num_pending_tokens += 1  # this step samples its next token
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.preempted_request_ids |= self._preempted_ids
        self._preempted_ids = set()
        return out

    def _is_short_prompt(self, request: Request) -> bool:
        """Whether a request is still computing its prompt (or, resumed after a preemption,
        its prompt and earlier outputs) and what is left fits in one step's budget."""
        left = request.num_tokens + request.num_pending_tokens - request.num_computed_tokens
        in_prompt = left > 1 or request.num_computed_tokens < request.num_prompt_tokens
        return in_prompt and left <= self.config.max_num_batched_tokens

    def _schedule_running(self, out: SchedulerOutput, scheduled: list[tuple[Request, int]],
                          budget: int, short_prompts_only: bool = False) -> int:
        """Grant running requests not yet scheduled this step, oldest first, the tokens they
        are behind by (only those in a short prompt if ``short_prompts_only``)."""
        taken = {request.request_id for request, _ in scheduled}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            i += 1
            if request.request_id in taken or self.beams.must_wait(request) or (
                    short_prompts_only and not self._is_short_prompt(request)):
                continue
            if (request.num_pending_tokens and request.max_total_tokens is not None
                    and request.num_tokens + 1 >= request.max_total_tokens):
                continue  # the token in flight is its last: nothing to compute after it
            num_new = min(request.num_tokens + request.num_pending_tokens
                          - request.num_computed_tokens, budget)
            if num_new <= 0 and self.pipelined:
                continue  # an embedding request, pooled by the step in flight
            if not self._lora_fits(request):
                continue  # its adapter would be one too many this step
            allocation, drafts = self._allocate_drafts(request, num_new, budget)
            if allocation is None:
                allocation = self._allocate_or_preempt(request, num_new, taken)
            if allocation is None:
                break  # request itself was preempted: only scheduled requests come after it
            out.kv_copies.extend(allocation.copies)
            if request.request_id in self.beams.unseen:
                # A new beam on its parent's blocks: the runner gets its whole state.
                self.beams.unseen.discard(request.request_id)
                out.new_requests.append(self._new_request_data(request))
            else:
                out.cached_requests.append(self._cached_request_data(request, allocation))
            if drafts:
                out.scheduled_spec_decode_tokens[request.request_id] = drafts
                num_new += len(drafts)
            scheduled.append((request, num_new))
            self._add_lora(request)
            taken.add(request.request_id)
            budget -= num_new
        return budget

    def _lora_fits(self, request: Request) -> bool:
        """Whether the step can run ``request``'s adapter (none, one already in the step,
        or one more within ``max_loras``)."""
        lora = request.lora_request
        return (lora is None or lora.lora_int_id in self._step_loras
                or len(self._step_loras) < self.max_loras)

    def _add_lora(self, request: Request) -> None:
        if request.lora_request is not None:
            self._step_loras.add(request.lora_request.lora_int_id)

    def _cached_request_data(self, request: Request,
                             allocation: SlotAllocation) -> CachedRequestData:
        """What the runner learns about a running request's blocks this step: the appended
        ones, or the whole list when a block inside it was swapped for a copy."""
        rid = request.request_id
        if allocation.rewritten:
            return CachedRequestData(rid, [], request.num_computed_tokens,
                                     block_ids=list(self.kv.get_block_ids(rid)))
        return CachedRequestData(rid, allocation.new_block_ids, request.num_computed_tokens)

    def _allocate_drafts(self, request: Request, num_new: int,
                         budget: int) -> tuple[SlotAllocation | None, list[int]]:
        """The slots and the draft tokens to verify, when a decoding request has drafts that
        fit in the budget and in free blocks; (None, []) otherwise. Drafts never preempt."""
        drafts, request.spec_token_ids = request.spec_token_ids[:budget - num_new], []
        if not drafts or num_new != 1 or request.num_computed_tokens + 1 != request.num_tokens:
            return None, []
        allocation = self.kv.allocate_slots(
            request.request_id, request.num_computed_tokens + 1 + len(drafts),
            request.num_computed_tokens)
        return (None, []) if allocation is None else (allocation, drafts)

    def set_draft_tokens(self, drafts: dict[str, list[int]]) -> None:
        """Draft tokens proposed for running requests, verified when next scheduled. Cut so
        that all of them accepted plus one more token stay within the request's length limit."""
        for rid, token_ids in drafts.items():
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            assert request.max_total_tokens is not None  # set by add_request
            room = request.max_total_tokens - request.num_tokens - 1
            request.spec_token_ids = token_ids[:max(room, 0)]

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             scheduled_ids: set[str]) -> SlotAllocation | None:
        """Slots for ``num_new`` more tokens of a running request, preempting the newest
        running requests not scheduled this step until they fit. None if ``request`` itself
        had to be preempted."""
        while True:
            allocation = self.kv.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new,
                request.num_computed_tokens)
            if allocation is not None:
                return allocation
            victim = next(r for r in reversed(self.running)
                          if r is request or r.request_id not in scheduled_ids)
            self.running.remove(victim)
            self._preempt(victim)
            if victim is request:
                return None

    def _admit_waiting(self, out: SchedulerOutput, scheduled: list[tuple[Request, int]],
                       budget: int, short_prompts_only: bool = False) -> int:
        """Start waiting requests in arrival order (only those whose prompt fits in a step's
        budget if ``short_prompts_only``) until one cannot start."""
        i = 0
        while i < len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_num_seqs and (
                    not self._release_reported_beams()):
                break
            request = self.waiting[i]
            source = prompt_source(request, self.requests)
            # A request preempted while a step in flight samples for it waits for that token.
            if request.num_pending_tokens or source is PromptSource.WAIT_FOR_LEADER or (
                    self.beams.must_wait(request)) or (
                    short_prompts_only and request.num_tokens > self.config.max_num_batched_tokens
            ) or not self._lora_fits(request):
                i += 1
                continue
            if source is PromptSource.SHARE_LEADER:
                num_new = fork_prompt(request, self.kv, out)
            else:
                num_new = start_prompt(request, self.kv, self.config, budget)
            if num_new is None:
                if self._release_reported_beams():
                    continue  # try again, with their blocks free
                break
            del self.waiting[i]
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            out.new_requests.append(self._new_request_data(request))
            scheduled.append((request, num_new))
            self._add_lora(request)
            budget -= num_new
        return budget

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=list(self.kv.get_block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
            grammar=request.grammar,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
        )

    def _release_reported_beams(self) -> bool:
        """Free the blocks and batch places of running beams that have run this step and wait
        for the rest of their group: only their children would read those blocks (and they
        then recompute from the prefix cache). Without this, groups whose last beam waits for
        blocks or places that other groups' waiting beams hold would wait forever."""
        released = self.beams.reported_running()
        for beam in released:
            self.running.remove(beam)
            # At the back: the admission loop's place in the queue stays (and must_wait
            # skips them until their group replaces them).
            self._preempt(beam, front=False)
        return bool(released)

    def _preempt(self, request: Request, front: bool = True) -> None:
        self.kv.free(request.request_id)
        self.beams.unseen.discard(request.request_id)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._preempted_ids.add(request.request_id)
        if front:
            # First among the waiting requests of its priority (all of them when every
            # request has the same priority).
            prio = _priority(request)
            at = next((i for i, r in enumerate(self.waiting) if _priority(r) >= prio),
                      len(self.waiting))
            self.waiting.insert(at, request)
        else:
            self.waiting.append(request)

    def _enqueue(self, request: Request) -> None:
        """Queue a new request after every waiting one of its priority or a more urgent one
        (vLLM's priority policy: ordered by priority, then arrival; FCFS when all are equal)."""
        prio = _priority(request)
        if not self.waiting or _priority(self.waiting[-1]) <= prio:
            self.waiting.append(request)
            return
        at = next(i for i, r in enumerate(self.waiting) if _priority(r) > prio)
        self.waiting.insert(at, request)

    def _preempt_for_priority(self) -> None:
        """While the most urgent waiting request is more urgent than the least urgent running
        one (the newest of its priority) and cannot start, for want of a batch place or of free
        blocks for its first chunk, preempt that running request (it is recomputed later).
        Nothing happens while all priorities are equal."""
        if not self.waiting or not self.running:
            return
        head = self.waiting[0]
        need = self.kv.blocks_needed(
            min(head.num_tokens, self.config.max_num_batched_tokens)) + 1
        while self.running:
            victim = max((r for r in self.running if r.beam is None),
                         key=lambda r: (_priority(r), r.arrival_time), default=None)
            if victim is None or _priority(victim) <= _priority(head):
                return
            if (len(self.running) < self.config.max_num_seqs
                    and self.kv.pool.num_free_blocks >= need):
                return
            self.running.remove(victim)
            self._preempt(victim)

    def update(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[EngineCoreOutput]:
        """Append the sampled tokens, finish requests that hit a stop condition."""
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        for rid in sched_out.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            pooled = runner_out.pooled.get(rid)
            if pooled is not None:
                outputs.append(self._finish_pooled(request, pooled))
                continue
            new_ids = runner_out.sampled_token_ids.get(rid, [])
            if request.num_pending_tokens and rid in runner_out.sampled_token_ids:
                request.num_pending_tokens -= 1
            drafts = sched_out.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                # Rejected drafts were computed but are not part of the sequence: their KV slots
                # get overwritten. The accepted ones and the last token are in the cache now.
                request.num_computed_tokens -= len(drafts) + 1 - len(new_ids)
            # Blocks this step filled (with tokens that stay) are now hits for later requests.
            # (With a step in flight behind this one, the computed count already includes the
            # token it computes, which is appended below.)
            self.kv.register_computed(rid, request.all_token_ids,
                                      min(request.num_computed_tokens, request.num_tokens))
            if request.beam is not None:
                # A beam's tokens are chosen by its group from its top logprobs.
                logprobs = runner_out.logprobs.get(rid)
                if logprobs:
                    outputs.extend(self.beams.report(request, logprobs[-1].top))
                continue
            status = None
            for n, token_id in enumerate(new_ids):
                request.append_output_token(token_id)
                status = request.check_stop()
                if status is not None:
                    del new_ids[n + 1:]
                    break
            if new_ids:
                _add_logprobs(request, runner_out.sampled_logprobs.get(rid), len(new_ids))
            if status is None and rid in runner_out.grammar_finished:
                status = RequestStatus.FINISHED_STOPPED
            if new_ids and request.first_token_time is None:
                request.first_token_time = now
            prompt_lps = runner_out.prompt_logprobs.get(rid)
            if not new_ids and not prompt_lps and status is None:
                continue
            if status is not None:
                # Preempted by a schedule made while this step ran (asynchronous scheduling),
                # the request waits: it leaves the queue it is in.
                queue = self.waiting if request.status == RequestStatus.PREEMPTED else self.running
                queue.remove(request)
                self.finish(request, status)
            outputs.append(EngineCoreOutput(
                request_id=rid,
                new_token_ids=new_ids,
                finish_reason=status.finish_reason if status else None,
                stop_reason=request.stop_reason,
                new_logprobs=runner_out.logprobs.get(rid),
                new_prompt_logprobs=prompt_lps,
                first_scheduled_time=request.first_scheduled_time,
                num_cached_tokens=request.num_cached_tokens,
                usage=request.usage.copy(),
                cumulative_logprob=request.cumulative_logprob,
            ))
        return outputs

    def _finish_pooled(self, request: Request, pooled: list[float]) -> EngineCoreOutput:
        """An embedding request whose prompt this step computed: it is done."""
        self.running.remove(request)
        self.finish(request, RequestStatus.FINISHED_STOPPED)
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                finish_reason="stop",
                                first_scheduled_time=request.first_scheduled_time,
                                pooled=pooled)

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = time.monotonic()
        self.kv.free(request.request_id)
        self.kv.forget(request.request_id)
        self._finished_ids.add(request.request_id)
        self._preempted_ids.discard(request.request_id)
        del self.requests[request.request_id]
        if request.lora_request is not None:
            lora_id = request.lora_request.lora_int_id
            self._lora_live[lora_id] -= 1
            if not self._lora_live[lora_id]:
                del self._lora_live[lora_id]

    def lora_in_use(self, lora_int_id: int) -> bool:
        """Whether an unfinished request runs the adapter (its weights must stay at hand)."""
        return lora_int_id in self._lora_live


def _add_logprobs(request: Request, logprobs: list[float] | None, num_tokens: int) -> None:
    """Add the logprobs of the ``num_tokens`` tokens the request kept this step."""
    if request.cumulative_logprob is None:
        return
    if logprobs is None or len(logprobs) < num_tokens:
        request.cumulative_logprob = None
    else:
        request.cumulative_logprob += sum(logprobs[:num_tokens])


def _lora_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The distinct adapters of ``requests``, by name, sorted."""
    return tuple(sorted({r.lora_request.lora_name for r in requests
                         if r.lora_request is not None}))


def _priority(request: Request) -> int:
    """A request's scheduling priority: lower runs first (vLLM's reading)."""
    return request.sampling_params.priority
