"""Beam search inside the scheduler: each step keeps the ``n`` best continuations of a
request's beams, and the beams share their KV blocks.

A beam search request starts as one request (its root). Each step, every live beam is one
row of the batch, and the runner gives each row's top-K logprobs. Once every live beam of a
group has them, :meth:`BeamGroup.select` ranks the continuations (Hugging Face's algorithm,
so that ``generate(num_beams=n)`` is the reference) and the scheduler replaces the beams by
the chosen ones: a new beam is a new request that shares its parent's KV blocks (copy-on-write:
only the last, partly filled block is copied, and only when two beams continue one parent),
so no token is computed twice. The group ends with its best ``n`` finished hypotheses, which
are the request's ``n`` outputs, best first.

Scoring, as in ``transformers``: a hypothesis's score is its summed logprob divided by its
generated length (the final token included) to the power ``length_penalty``. A continuation
finishes when its token ends generation (an eos id or a stop token id) or reaches the length
limit, and counts only if it ranks among the top ``n`` of the step's top K. K is
``max(2, 1 + number of ending ids) * n``, enough that ``n`` beams always go on.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.core.sched_output import EngineCoreOutput
from tokenmill.outputs import ComputeUsage, TokenLogprobs
from tokenmill.request import BeamSpec, Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.core.scheduler import Scheduler


@dataclass
class Hypothesis:
    """A finished beam: its output tokens, summed logprob and length-penalised score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str
    stop_reason: int | None = None
    # Per token, its logprob, rank and the top alternatives (when the request asked).
    logprobs: list[TokenLogprobs] | None = None


# A beam's per-token logprobs, newest last, each step's entry pointing at its parent's trail
# (beams share their history; a hypothesis's list is spelt out only when it finishes).
Trail = tuple["Trail | None", TokenLogprobs]


def _spell(trail: Trail | None) -> list[TokenLogprobs]:
    entries = []
    while trail is not None:
        trail, entry = trail
        entries.append(entry)
    return entries[::-1]


@dataclass
class Continuation:
    """One candidate of a step: live beam ``parent`` followed by ``token_id``."""

    parent: int
    token_id: int
    cumulative_logprob: float
    # Its beam's logprobs trail, the new token's entry included (None unless asked for).
    trail: Trail | None = None


@dataclass
class Selection:
    """What one step of a group decided: the beams that go on (best first), and whether the
    search is over."""

    beams: list[Continuation]
    done: bool


def num_candidates(beam_width: int, num_ending_ids: int) -> int:
    """K: how many continuations a step ranks (``transformers``' beams_to_keep)."""
    return max(2, 1 + num_ending_ids) * beam_width


@dataclass
class BeamGroup:
    """The state of one beam search request."""

    spec: BeamSpec
    max_new_tokens: int = 0
    live: list[Request] = field(default_factory=list)
    # The top logprobs of each live beam that has run this step: [(token id, logprob)].
    candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # With SamplingParams.logprobs: each live beam's trail, and its step's raw top logprobs.
    trails: dict[str, Trail | None] = field(default_factory=dict)
    raw: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    num_generated: int = 0
    num_steps: int = 0
    # False once no live beam can beat the finished hypotheses (the early-stop heuristic).
    improvable: bool = True
    # The compute of the beams that have ended.
    usage: ComputeUsage = field(default_factory=ComputeUsage)

    @property
    def root_id(self) -> str:
        return self.spec.output_ids[0]

    @property
    def beam_width(self) -> int:
        return self.spec.beam_width

    @property
    def ending_ids(self) -> frozenset[int]:
        return self.spec.ending_ids

    @property
    def num_candidates(self) -> int:
        return num_candidates(self.beam_width, len(self.ending_ids))

    def start(self, root: Request) -> None:
        """Begin with ``root``, the request holding the prompt (length limits are final)."""
        assert root.max_total_tokens is not None  # set by Scheduler.add_request
        self.live = [root]
        self.max_new_tokens = root.max_total_tokens - root.num_prompt_tokens

    def has_reported(self, request: Request) -> bool:
        """Whether ``request`` has run this step (it waits for the group's selection)."""
        return request.request_id in self.candidates

    def report(self, request: Request, top: dict[int, float]) -> bool:
        """Record a live beam's top logprobs; True when every live beam has them."""
        ranked = sorted(top.items(), key=lambda item: -item[1])
        if self.spec.logprobs is not None:
            self.raw[request.request_id] = ranked
        if self.num_generated + 1 <= self.spec.min_tokens:
            # Too short to end yet: the ending tokens are no candidates (transformers masks
            # them; the runner gave K more than needed for this).
            ranked = [c for c in ranked if c[0] not in self.ending_ids]
        self.candidates[request.request_id] = ranked[:self.num_candidates]
        return all(beam.request_id in self.candidates for beam in self.live)

    def select(self) -> Selection:
        """Rank the live beams' continuations, keep the finished ones that rank in the top
        ``n``, and choose the beams that go on."""
        k, n = self.num_candidates, self.beam_width
        pool = [Continuation(i, token_id, _cumulative(beam) + logprob,
                             self._trail(beam.request_id, token_id, logprob))
                for i, beam in enumerate(self.live)
                for token_id, logprob in self.candidates[beam.request_id]]
        # sorted() is stable: equal scores keep the beams' order, then the tokens'.
        top = sorted(pool, key=lambda c: -c.cumulative_logprob)[:k]
        length = self.num_generated + 1
        ends = [self._ends(c, length) for c in top]
        going_on = [c for c, end in zip(top, ends, strict=True) if not end][:n]
        if self.improvable and not self._full_and_stopping():
            for c, end in zip(top[:n], ends[:n], strict=True):
                if end:
                    self.finished.append(self._hypothesis(c, length))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[n:]
        self.num_generated = length
        self.num_steps += 1
        self.candidates, self.raw = {}, {}
        self._update_improvable(going_on)
        done = not going_on or not self.improvable or self._full_and_stopping()
        return Selection(going_on, done)

    def results(self) -> list[Hypothesis]:
        """The best ``n`` finished hypotheses, best first."""
        return list(self.finished)

    def _trail(self, beam_id: str, token_id: int, logprob: float) -> Trail | None:
        """The trail of ``beam_id`` followed by ``token_id`` (None without logprobs)."""
        k = self.spec.logprobs
        if k is None:
            return None
        raw = self.raw[beam_id]
        rank = 1 + sum(1 for _, lp in raw if lp > logprob)
        return (self.trails.get(beam_id), TokenLogprobs(token_id, logprob, rank, dict(raw[:k])))

    def _ends(self, c: Continuation, length: int) -> bool:
        return c.token_id in self.ending_ids or length >= self.max_new_tokens

    def _full_and_stopping(self) -> bool:
        return self.spec.early_stopping is True and len(self.finished) >= self.beam_width

    def _hypothesis(self, c: Continuation, length: int) -> Hypothesis:
        parent = self.live[c.parent]
        if c.token_id in self.ending_ids:
            reason = "stop"
            stop_reason = c.token_id if c.token_id in self.spec.stop_token_ids else None
        else:
            reason, stop_reason = "length", None
        score = c.cumulative_logprob / (length ** self.spec.length_penalty)
        logprobs = None if self.spec.logprobs is None else _spell(c.trail)
        return Hypothesis([*parent.output_token_ids, c.token_id], c.cumulative_logprob, score,
                          reason, stop_reason, logprobs)

    def _update_improvable(self, going_on: list[Continuation]) -> None:
        """transformers' early-stop heuristic: once ``n`` hypotheses are finished, stop when
        the best live beam, at its current length (at the length limit for "never" with a
        positive length_penalty), scores no better than the worst of them."""
        if len(self.finished) < self.beam_width or not going_on:
            return
        length = self.num_generated
        penalty = self.spec.length_penalty
        if self.spec.early_stopping == "never" and penalty > 0:
            length = self.max_new_tokens
        best = going_on[0].cumulative_logprob / (length ** penalty)
        if best <= self.finished[-1].score:
            self.improvable = False


def beam_search_request(request_id: str, token_ids: list[int], params: SamplingParams,
                        eos_token_ids: frozenset[int], vocab_size: int,
                        arrival_time: float) -> Request:
    """The root request of a beam search (``params.use_beam_search``), whose ``n`` outputs
    the output processor knows as ``request_id`` (n = 1) or ``request_id#i``; ValueError when
    the vocabulary is too small for the beams' candidates."""
    n = params.n
    stop_ids = frozenset(params.stop_token_ids or ())
    ending = stop_ids | (frozenset() if params.ignore_eos else eos_token_ids)
    k = num_candidates(n, len(ending))
    # While min_tokens holds the ending ids back, they may fill the top logprobs: ask for
    # as many more, so that K others remain.
    wanted = k + (len(ending) if params.min_tokens else 0)
    if params.logprobs is not None:
        wanted = max(wanted, params.logprobs)
    if wanted > vocab_size:
        raise ValueError(f"n (the beam width) is {n}: with {len(ending)} ending token ids "
                         f"(eos and stop_token_ids){' and min_tokens' if params.min_tokens else ''}"
                         f" beam search ranks {wanted} candidates per beam, more than the "
                         f"vocabulary's {vocab_size} tokens")
    output_ids = (request_id,) if n == 1 else tuple(f"{request_id}#{i}" for i in range(n))
    spec = BeamSpec(output_ids, params.length_penalty, params.early_stopping, ending,
                    stop_ids, params.min_tokens, params.logprobs)
    # Each beam is one greedy row that reports its top logprobs (their count is past the API's
    # bound, so it is set on the engine's own copy, after validation).
    core_params = dataclasses.replace(params, n=1, temperature=0.0, seed=None,
                                      speculative=False, use_beam_search=False)
    core_params.logprobs = wanted
    # Ending is the group's decision: a beam never stops on its own before the length limit.
    core_params.ignore_eos = True
    core_params.stop_token_ids = []
    core_params.min_tokens = 0
    return Request(output_ids[0], token_ids, core_params, eos_token_ids,
                   arrival_time=arrival_time, beam=spec)


def _cumulative(request: Request) -> float:
    assert request.cumulative_logprob is not None  # beams always carry one
    return request.cumulative_logprob


class BeamSearches:
    """The scheduler's beam search groups: it reports each beam's logprobs here, and this
    replaces the beams with the chosen continuations (new requests on their parents' KV
    blocks) or ends the group with its outputs."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # By root request id, and by the id of each live beam.
        self.groups: dict[str, BeamGroup] = {}
        self.group_of: dict[str, BeamGroup] = {}
        # Beams the runner has not seen yet: their first schedule sends their whole state.
        self.unseen: set[str] = set()

    def start(self, root: Request) -> None:
        assert root.beam is not None
        group = BeamGroup(root.beam)
        group.start(root)
        self.groups[group.root_id] = group
        self.group_of[root.request_id] = group

    def must_wait(self, request: Request) -> bool:
        """Whether a beam cannot run now: it has run this step and waits for its group (or
        for the token in flight that ends its step, with asynchronous scheduling)."""
        group = self.group_of.get(request.request_id)
        return group is not None and (group.has_reported(request)
                                      or request.num_pending_tokens > 0)

    def reported_running(self) -> list[Request]:
        """The running beams that have run this step (their blocks only serve their
        children now); not those whose token is still in flight."""
        return [beam for group in self.groups.values() for beam in group.live
                if beam.status == RequestStatus.RUNNING and group.has_reported(beam)
                and not beam.num_pending_tokens]

    def report(self, request: Request, top: dict[int, float]) -> list[EngineCoreOutput]:
        """A beam's top logprobs from the step that ran it; the group's outputs when this
        ends it."""
        group = self.group_of[request.request_id]
        if not group.report(request, top):
            return []
        selection = group.select()
        old = group.live
        if selection.done:
            self._end_beams(group, old)
            del self.groups[group.root_id]
            return self._outputs(group, old[0])
        group.live = [self._spawn(group, old[c.parent], c, j)
                      for j, c in enumerate(selection.beams)]
        self._place(old, group.live)
        self._end_beams(group, old)
        return []

    def abort(self, root_id: str, status: RequestStatus) -> bool:
        """End the group whose root is ``root_id``; False when there is none."""
        group = self.groups.pop(root_id, None)
        if group is None:
            return False
        self._end_beams(group, group.live, status)
        return True

    def _spawn(self, group: BeamGroup, parent: Request, c: Continuation, j: int) -> Request:
        child = Request(f"{group.root_id}#beam{group.num_steps}.{j}",
                        parent.prompt_token_ids, parent.sampling_params,
                        parent.eos_token_ids, max_total_tokens=parent.max_total_tokens,
                        arrival_time=parent.arrival_time, lora_request=parent.lora_request)
        child.output_token_ids = [*parent.output_token_ids, c.token_id]
        child.all_token_ids = [*parent.all_token_ids, c.token_id]
        child.cumulative_logprob = c.cumulative_logprob
        child.beam = parent.beam
        self.group_of[child.request_id] = group
        if c.trail is not None:
            group.trails[child.request_id] = c.trail
        child.first_scheduled_time = parent.first_scheduled_time
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_token_time = parent.first_token_time
        self.scheduler.register(child)
        if parent.status == RequestStatus.RUNNING and parent.num_computed_tokens >= parent.num_tokens:
            # The parent's KV holds every token before the new one: share it.
            self.scheduler.kv.fork(parent.request_id, child.request_id, parent.num_tokens)
            child.num_computed_tokens = parent.num_tokens
            child.status = RequestStatus.RUNNING
        return child

    def _place(self, old: list[Request], new: list[Request]) -> None:
        """Put the new beams where the old ones ran in the running queue (so they keep their
        age when preemption picks the newest); those that do not fit wait, without KV."""
        sched = self.scheduler
        old_ids = {r.request_id for r in old}
        # Where the first old beam was (nothing before it is old, so the index holds after
        # the old ones are taken out).
        at = next((i for i, r in enumerate(sched.running) if r.request_id in old_ids),
                  len(sched.running))
        running = [r for r in sched.running if r.request_id not in old_ids]
        fits: list[Request] = []
        for child in new:
            if child.status == RequestStatus.RUNNING and (
                    len(running) + len(fits) < sched.config.max_num_seqs):
                fits.append(child)
                self.unseen.add(child.request_id)
            else:
                sched.kv.free(child.request_id)
                child.num_computed_tokens = 0
                child.status = RequestStatus.WAITING
                sched.waiting.appendleft(child)
        sched.running = running[:at] + fits + running[at:]

    def _end_beams(self, group: BeamGroup, beams: list[Request],
                   status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        sched = self.scheduler
        ending = [beam for beam in beams if not beam.is_finished]
        ids = {beam.request_id for beam in ending}
        # Out of the queues in one pass each (_place has taken replaced beams out already).
        sched.running = [r for r in sched.running if r.request_id not in ids]
        if any(beam.status != RequestStatus.RUNNING for beam in ending):
            sched.waiting = deque(r for r in sched.waiting if r.request_id not in ids)
        for beam in beams:
            self.group_of.pop(beam.request_id, None)
            group.trails.pop(beam.request_id, None)
        for beam in ending:
            self.unseen.discard(beam.request_id)
            group.usage.add(beam.usage)
            sched.finish(beam, status)

    def _outputs(self, group: BeamGroup, last: Request) -> list[EngineCoreOutput]:
        """One output per hypothesis, best first. (Fewer than n hypotheses only when fewer
        than n continuations had a finite logprob: the rest end empty.)"""
        results = group.results()
        outputs = []
        for i, rid in enumerate(group.spec.output_ids):
            hyp = results[i] if i < len(results) else Hypothesis([], float("-inf"),
                                                                 float("-inf"), "length")
            outputs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=hyp.token_ids, finish_reason=hyp.finish_reason,
                stop_reason=hyp.stop_reason, first_scheduled_time=last.first_scheduled_time,
                num_cached_tokens=last.num_cached_tokens,
                usage=group.usage.copy() if i == 0 else ComputeUsage(),
                cumulative_logprob=hyp.cumulative_logprob, new_logprobs=hyp.logprobs))
        return outputs
