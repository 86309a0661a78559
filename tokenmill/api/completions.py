"""Completions: one or more prompts (text or token ids) validated into engine prompts and
SamplingParams, and the answer built whole or as streamed chunks (echo, best_of, logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from tokenmill.api.chat import MAX_CHARS_PER_TOKEN
from tokenmill.api.errors import bad_request
from tokenmill.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from tokenmill.api.response_building import Collected, TokenTexts, finite
from tokenmill.api.validation import (
    ServedModel,
    beam_max_tokens,
    check_context,
    check_grammar,
    check_token_ids,
    sampling_params,
)
from tokenmill.engine.llm_engine import PromptType
from tokenmill.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from tokenmill.sampling_params import MAX_N, SamplingParams
from tokenmill.tokenizer import Tokenizer


@dataclass
class CompletionPrompt:
    """One prompt of a completions request, as the engine and the response need it."""

    engine_prompt: PromptType
    token_ids: list[int]
    text: str  # for echo


def _prompts(req: CompletionRequest, tok: Tokenizer, vocab: int, max_chars: int,
             split_special_tokens: bool) -> list[CompletionPrompt]:
    """Tokenized, validated prompts; 400 names what is wrong. ``split_special_tokens``: read
    special-token text in text prompts as plain text."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # type: ignore[list-item]
    if not raw:
        raise bad_request("prompt must not be empty", "prompt")
    out = []
    for p in raw:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be an empty string", "prompt")
            if len(p) > max_chars:
                raise bad_request(f"the prompt has {len(p)} characters, more than the "
                                  f"{max_chars} this model's context can take", "prompt")
            ids = tok.encode_plain(p, add_special_tokens=True) if split_special_tokens \
                else tok.encode(p)
            out.append(CompletionPrompt({"prompt": p, "prompt_token_ids": ids}, ids, p))
        else:
            check_token_ids(p, vocab, "prompt")
            text = tok.decode(p, skip_special_tokens=False)
            out.append(CompletionPrompt(list(p), list(p), text))
    return out


def completion_logprobs(token_ids: list[int], lps: list[TokenLogprobs | None], k: int,
                        texts: TokenTexts, offset: int) -> CompletionLogprobs:
    """The legacy completions ``logprobs`` object; a None entry (first prompt token) has none."""
    out = CompletionLogprobs()
    for tid, lp in zip(token_ids, lps, strict=True):
        token = texts(tid)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(finite(lp.logprob))
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:k]
        out.top_logprobs.append({texts(t): finite(v) for t, v in top})
    return out


def _merge(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def _echo_logprobs(prompt: CompletionPrompt, lps: list[TokenLogprobs | None] | None, k: int,
                   texts: TokenTexts) -> CompletionLogprobs:
    entries = list(lps or [None])
    entries += [None] * (len(prompt.token_ids) - len(entries))
    return completion_logprobs(prompt.token_ids, entries[:len(prompt.token_ids)], k, texts, 0)


@dataclass
class CompletionCall:
    """A validated completions request: its prompts (one engine request each) and its
    sampling parameters (``n`` is best_of: the best ``req.n`` of them are answered)."""

    id_prefix: ClassVar[str] = "cmpl"
    req: CompletionRequest
    prompts: list[CompletionPrompt]
    params: SamplingParams
    tokenizer: Tokenizer
    # ``max_tokens: 0`` with ``echo``: the prompt only, scored (its logprobs when asked), as
    # OpenAI's legacy API answered it; the engine samples one token that is not reported.
    score_only: bool = False

    @property
    def engine_prompts(self) -> list[PromptType]:
        return [p.engine_prompt for p in self.prompts]

    def response(self, result: Collected, model: str, rid: str,
                 created: int) -> CompletionResponse:
        """The whole (non-streamed) response body of the finished request."""
        req, texts, k = self.req, TokenTexts(self.tokenizer), self.req.logprobs
        choices = []
        for p_index, (prompt, per_prompt) in enumerate(zip(self.prompts, result.choices,
                                                           strict=True)):
            # best_of: the most likely samples (beam search's hypotheses come best first).
            if len(per_prompt) > req.n and not self.params.use_beam_search:
                per_prompt = sorted(per_prompt,
                                    key=lambda c: -sum(lp.logprob for lp in c.logprobs))
            for c_index, c in enumerate(per_prompt[:req.n]):
                text = "" if self.score_only else "".join(c.text)
                lps = None
                if k is not None:
                    ids = [] if self.score_only else [lp.token_id for lp in c.logprobs]
                    offset = len(prompt.text) if req.echo else 0
                    lps = completion_logprobs(ids, [] if self.score_only else list(c.logprobs),
                                              k, texts, offset)
                    if req.echo:
                        lps = _merge(_echo_logprobs(prompt, result.prompt_logprobs[p_index], k,
                                                    texts), lps)
                choices.append(CompletionChoice(
                    index=p_index * req.n + c_index,
                    text=prompt.text + text if req.echo else text, logprobs=lps,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage = result.usage()
        if self.score_only:
            usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
        return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=usage)

    def chunks(self, model: str, rid: str, created: int) -> CompletionChunks:
        """The builder of this request's streamed chunks (see StreamChunks)."""
        return CompletionChunks(self, model, rid, created)


@dataclass
class CompletionChunks:
    """Streamed chunks of new text per choice; a choice's first one carries the echo."""

    call: CompletionCall
    model: str
    rid: str
    created: int
    started: set[int] = field(default_factory=set)  # choices that sent text (and their echo)
    # A finished sequence keeps its finish_reason in later deltas: send nothing more for it.
    done: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=dict)  # text sent so far, per choice

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.call.tokenizer)

    def _chunk(self, choices: list[CompletionChoice],
               usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model,
                                  choices=choices, usage=usage)

    def opening(self) -> list[CompletionResponse]:
        return []

    def delta(self, index: int, out: RequestOutput) -> CompletionResponse | None:
        prompt, choices = self.call.prompts[index], []
        for c in out.outputs:
            choice_index = index * self.call.req.n + c.index
            if choice_index in self.done or (not c.token_ids and not c.finished):
                continue
            choice = self._choice(prompt, out.prompt_logprobs, c, choice_index)
            self.started.add(choice_index)
            self.offsets[choice_index] = self.offsets.get(choice_index, 0) + len(choice.text)
            if c.finished:
                self.done.add(choice_index)
            choices.append(choice)
        return self._chunk(choices) if choices else None

    def _choice(self, prompt: CompletionPrompt, prompt_lps: list[TokenLogprobs | None] | None,
                c: CompletionOutput, index: int) -> CompletionChoice:
        """One choice's delta; the first one of a choice carries the prompt when echoing."""
        req, texts = self.call.req, self.texts
        echo = req.echo and index not in self.started
        lps = None
        if req.logprobs is not None:
            own = list(c.logprobs or [])
            base = self.offsets.get(index, 0) + (len(prompt.text) if echo else 0)
            lps = completion_logprobs([lp.token_id for lp in own], own, req.logprobs, texts,
                                      base)
            if echo:
                lps = _merge(_echo_logprobs(prompt, prompt_lps, req.logprobs, texts), lps)
        return CompletionChoice(index=index, text=prompt.text + c.text if echo else c.text,
                                logprobs=lps, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)

    def usage(self, usage: UsageInfo) -> CompletionResponse:
        return self._chunk([], usage)


def prepare_completion(req: CompletionRequest, served: ServedModel, *,
                       split_special_tokens: bool = False) -> CompletionCall:
    """The prompts and sampling parameters of a completions request; 400 names the bad field.
    ``split_special_tokens``: special-token text in text prompts is plain text.

    Shared by the server and the batch job, so both accept and reject the same bodies."""
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    best_of = req.n if req.best_of is None else req.best_of
    if req.best_of is not None and not req.n <= best_of <= MAX_N:
        raise bad_request(f"best_of must be in [n ({req.n}), {MAX_N}], got {best_of}",
                          "best_of")
    if best_of > req.n and req.stream:
        raise bad_request("best_of > n cannot be streamed: the best are known only at the end",
                          "best_of")
    tokenizer, vocab_size = served.tokenizer, served.vocab_size
    prompts = _prompts(req, tokenizer, vocab_size, served.max_model_len * MAX_CHARS_PER_TOKEN,
                       split_special_tokens)
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise bad_request("max_tokens 0 asks for the prompt alone: it needs echo: true",
                          "max_tokens")
    if score_only and req.stream:
        raise bad_request("max_tokens 0 (score the prompt) cannot be streamed", "stream")
    max_tokens = 1 if score_only else req.max_tokens
    for p in prompts:
        check_context(len(p.token_ids), max_tokens, served.max_model_len, "prompt")
    max_tokens = beam_max_tokens(req, max_tokens, [len(p.token_ids) for p in prompts],
                                 served.max_model_len)
    # best_of ranks its samples by the sum of their tokens' logprobs: ask for those. With
    # beam search best_of is the beam width (vLLM's older meaning), its hypotheses ranked.
    k = req.logprobs
    ranks_samples = best_of > req.n and not req.use_beam_search
    params = sampling_params(req, vocab_size, max_tokens=max_tokens,
                             logprobs=0 if k is None and ranks_samples else k,
                             prompt_logprobs=k if req.echo else None)
    check_grammar(req, params, served)
    return CompletionCall(req, prompts, replace(params, n=best_of), tokenizer, score_only)
