"""Turns the core's token ids into RequestOutputs: incremental text, stop strings, n > 1."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.core.sched_output import EngineCoreOutput
from tokenmill.detokenizer import IncrementalDetokenizer, StopChecker
from tokenmill.outputs import (
    CompletionOutput,
    ComputeUsage,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer


class OutputKind(enum.Enum):
    """What each RequestOutput of a request carries."""

    CUMULATIVE = "cumulative"  # everything so far, after every step
    DELTA = "delta"  # only what is new since the last output (for streaming)
    FINAL_ONLY = "final"  # one output, when the request has finished


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    # How much of text / token_ids / logprobs / latencies went out in DELTA mode.
    sent: tuple[int, int, int, int] = (0, 0, 0, 0)
    usage: ComputeUsage = field(default_factory=ComputeUsage)
    cumulative_logprob: float | None = None
    # token_ids[:detokenized] have gone through the detokenizer (see OutputProcessor._apply).
    detokenized: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    sequences: list[_Sequence]
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    """Keeps the per-request text state that lives outside the engine core."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        # child request id (as known to the core) -> (parent id, sequence index)
        self.children: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, child_ids: list[str], prompt: str | None,
                    prompt_token_ids: list[int], params: SamplingParams, kind: OutputKind,
                    arrival_time: float) -> None:
        seqs = []
        for i, child_id in enumerate(child_ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                           skip_special_tokens=params.skip_special_tokens)
            stop = StopChecker(params.stop_strings, params.include_stop_str_in_output)
            seqs.append(_Sequence(i, detok, stop, logprobs=[] if params.logprobs is not None
                                  else None))
            self.children[child_id] = (request_id, i)
        prompt_lps: list[TokenLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None]  # the first prompt token has no logprob
        self.parents[request_id] = _Parent(
            request_id, prompt, prompt_token_ids, params, kind, seqs,
            RequestMetrics(arrival_time=arrival_time, max_tokens=params.max_tokens), prompt_lps)

    def child_ids(self, request_id: str) -> list[str]:
        return [c for c, (p, _) in self.children.items() if p == request_id]

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns RequestOutputs to deliver and child ids that hit a
        stop string (the caller must finish those in the core)."""
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        for out in core_outputs:
            where = self.children.get(out.request_id)
            if where is None:
                continue  # aborted meanwhile
            parent = self.parents[where[0]]
            seq = parent.sequences[where[1]]
            if self._apply(parent, seq, out, now):
                stopped.append(out.request_id)
            touched[parent.request_id] = parent
        return self._emit(touched.values()), stopped

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted; its final output, or None if it was unknown."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.sequences:
            if seq.finish_reason is None:
                if seq.detokenized < len(seq.token_ids):
                    self._detokenize_rest(seq)
                seq.finish_reason = "abort"
        outs = self._emit([parent])
        return outs[0] if outs else None

    def _apply(self, parent: _Parent, seq: _Sequence, out: EngineCoreOutput, now: float) -> bool:
        metrics = parent.metrics
        seq.cumulative_logprob = out.cumulative_logprob
        if out.usage is not None:
            seq.usage = out.usage
            metrics.usage = ComputeUsage.total([s.usage for s in parent.sequences])
        if out.first_scheduled_time is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = out.first_scheduled_time
        if out.num_cached_tokens is not None and seq.index == 0:
            metrics.num_cached_tokens = out.num_cached_tokens
        # Every sample of an n > 1 request computes the same prompt: report it once.
        if out.new_prompt_logprobs and parent.prompt_logprobs is not None and seq.index == 0:
            parent.prompt_logprobs.extend(out.new_prompt_logprobs)
        if out.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if seq.last_token_time is not None:
                seq.inter_token_latencies.append(now - seq.last_token_time)
            seq.last_token_time = now
            metrics.last_token_time = now
        ids = out.new_token_ids
        # No one reads a FINAL_ONLY request's text before the end, and without stop strings
        # nothing else needs it: its tokens are detokenized once, when it finishes (at batch
        # 256 this phase of the host's work went from 4.3-5.0 to 1.3 ms a step on the CPU;
        # benchmarks/results/host-overhead-final-only-cpu.json).
        deferred = parent.kind is OutputKind.FINAL_ONLY and not seq.stop.stop_strings
        # Several tokens in one step (speculative decoding) go through the stop strings one at
        # a time, so that the output ends at the token that completes a stop string.
        step = 1 if seq.stop.stop_strings else max(len(ids), 1)
        for i in range(0, max(len(ids), 1), step):
            final = out.finished and i + step >= len(ids)
            seq.token_ids.extend(ids[i:i + step])
            if seq.logprobs is not None and out.new_logprobs:
                seq.logprobs.extend(out.new_logprobs[i:i + step])
            if deferred:
                if final:
                    self._detokenize_rest(seq)
                continue
            seq.detokenized = len(seq.token_ids)
            delta = seq.detokenizer.add_tokens(ids[i:i + step])
            if final:
                delta += seq.detokenizer.flush()
            safe, matched = seq.stop.feed(delta, final=final)
            seq.text += safe
            if matched is not None:
                seq.finish_reason, seq.stop_reason = "stop", matched
                return not out.finished
        if out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return False

    @staticmethod
    def _detokenize_rest(seq: _Sequence) -> None:
        """The text of the tokens not yet detokenized, as the last step's (flushed)."""
        delta = seq.detokenizer.add_tokens(seq.token_ids[seq.detokenized:])
        seq.detokenized = len(seq.token_ids)
        safe, _ = seq.stop.feed(delta + seq.detokenizer.flush(), final=True)
        seq.text += safe

    def _emit(self, parents: object) -> list[RequestOutput]:
        results = []
        for parent in list(parents):  # type: ignore[call-overload]
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = time.monotonic()
                del self.parents[parent.request_id]
                for child in [c for c, (p, _) in self.children.items() if p == parent.request_id]:
                    del self.children[child]
            if parent.kind is OutputKind.FINAL_ONLY and not finished:
                continue
            outputs = [self._completion(parent.kind, s) for s in parent.sequences]
            results.append(RequestOutput(
                request_id=parent.request_id, prompt=parent.prompt,
                prompt_token_ids=parent.prompt_token_ids, outputs=outputs, finished=finished,
                metrics=parent.metrics, prompt_logprobs=parent.prompt_logprobs))
        return results

    @staticmethod
    def _completion(kind: OutputKind, seq: _Sequence) -> CompletionOutput:
        if kind is not OutputKind.DELTA:
            return CompletionOutput(seq.index, seq.text, list(seq.token_ids), seq.finish_reason,
                                    seq.stop_reason, seq.logprobs and list(seq.logprobs),
                                    list(seq.inter_token_latencies), seq.cumulative_logprob)
        t, n, lp, itl = seq.sent
        seq.sent = (len(seq.text), len(seq.token_ids), len(seq.logprobs or []),
                    len(seq.inter_token_latencies))
        return CompletionOutput(seq.index, seq.text[t:], seq.token_ids[n:], seq.finish_reason,
                                seq.stop_reason, None if seq.logprobs is None else seq.logprobs[lp:],
                                seq.inter_token_latencies[itl:], seq.cumulative_logprob)
