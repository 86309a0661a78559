"""Classification by exact label scoring: each input's chat prompt, every label's tokens after
it, and the softmax over the labels of each label's summed token log-probabilities.

A label is scored by one engine request over prompt + label tokens with ``prompt_logprobs``:
the prefill gives the logprob of each label token after everything before it. An input's
first label computes the prompt; its other labels are submitted once that one has finished,
so the prefix cache serves the prompt's full blocks and each of them computes little more than
its own tokens (``prompt_logprobs_start`` lets the cache serve a request that wants prompt
logprobs). ``LabelScorer`` holds that plan and the scores; a driver submits what it hands out:
``run_label_scoring`` for the synchronous engine, the server's and the batch job's for theirs.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import ClassificationResult, TokenLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer

# More labels than a router needs; each is one engine request per input.
MAX_LABELS = 64
# Tokens of one label: a label is a name, not a text.
MAX_LABEL_TOKENS = 64
# Label requests a synchronous run keeps in the engine at once (whole inputs at a time): few
# enough that an input's prompt blocks are still cached when its other labels run.
MAX_LABEL_REQUESTS_IN_FLIGHT = 128

# What rendering the chat template can raise on the data it is fed: a user error.
_TEMPLATE_ERRORS = (ValueError, TypeError, LookupError, ArithmeticError, jinja2.TemplateError)


class ClassifyInputError(ValueError):
    """A classify request that cannot be scored; ``param`` names its field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def default_instruction(labels: Sequence[str]) -> str:
    """The system message when the caller gives none: the task and the labels."""
    listed = "\n".join(f"- {label}" for label in labels)
    return ("Classify the user's message. Answer with exactly one of these labels and nothing "
            f"else:\n{listed}")


def check_labels(labels: Any) -> list[str]:
    """The labels, or ClassifyInputError: a non-empty list of at most MAX_LABELS distinct,
    non-empty strings."""
    if not isinstance(labels, list | tuple):
        raise ClassifyInputError(
            f"labels must be a list of strings, got {type(labels).__name__}", "labels")
    if not labels:
        raise ClassifyInputError("labels must not be empty", "labels")
    if len(labels) > MAX_LABELS:
        raise ClassifyInputError(
            f"labels may hold at most {MAX_LABELS} labels, got {len(labels)}", "labels")
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        if not isinstance(label, str):
            raise ClassifyInputError(
                f"labels[{i}] must be a string, got {type(label).__name__}", "labels")
        if not label:
            raise ClassifyInputError(f"labels[{i}] must not be an empty string", "labels")
        first = seen.setdefault(label, i)
        if first != i:
            raise ClassifyInputError(
                f"labels[{i}] {label!r} repeats labels[{first}]; labels must be distinct",
                "labels")
    return list(labels)


def check_inputs(inputs: Any) -> list[str]:
    """The inputs as a list (one string is one input), or ClassifyInputError."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list | tuple):
        raise ClassifyInputError(
            f"input must be a string or a list of strings, got {type(inputs).__name__}",
            "input")
    if not inputs:
        raise ClassifyInputError("input must not be empty", "input")
    for i, text in enumerate(inputs):
        if not isinstance(text, str):
            raise ClassifyInputError(
                f"input[{i}] must be a string, got {type(text).__name__}", "input")
        if not text:
            raise ClassifyInputError(f"input[{i}] must not be an empty string", "input")
    return list(inputs)


def classify_prompt(tokenizer: Tokenizer, text: str, instruction: str,
                    max_chars: int | None = None) -> list[int]:
    """Token ids of the prompt the labels follow: the chat template with the instruction as
    the system message and ``text`` as the user's, ready for the assistant's turn (a model
    without a template gets the two as plain text, one line after the other)."""
    if tokenizer.chat_template is None:
        plain = f"{instruction}\n\n{text}\n"
        if max_chars is not None and len(plain) > max_chars:
            raise ClassifyInputError(f"the prompt has {len(plain)} characters, more than the "
                                     f"{max_chars} this model's context can take", "input")
        return tokenizer.encode_plain(plain, add_special_tokens=True)
    messages = [{"role": "system", "content": instruction}, {"role": "user", "content": text}]
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=True,
                                     max_chars=max_chars)[1]
    except _TEMPLATE_ERRORS as e:
        raise ClassifyInputError(f"input: {e}", "input") from None


def label_probs(logprobs: Sequence[float]) -> list[float]:
    """The softmax of the labels' summed logprobs."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class LabelRequest:
    """One label of one input to score: an engine request over prompt + label tokens."""

    input_index: int
    label_index: int
    token_ids: list[int]
    params: SamplingParams

    @property
    def prompt(self) -> dict[str, list[int]]:
        """The engine prompt."""
        return {"prompt_token_ids": self.token_ids}


class LabelScorer:
    """The label requests of one classification call and the scores they bring back.

    Hand ``first_requests()`` to the engine; give each finished request's prompt logprobs to
    ``record``, which hands back the requests to submit next (an input's other labels, once
    its first has computed the prompt); ``results()`` once ``done``. ClassifyInputError, naming
    the field, for inputs or labels that cannot be scored within ``max_model_len``;
    ``max_chars`` bounds a rendered prompt before it is tokenized."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, inputs: Any, labels: Any,
                 instruction: str | None = None, *, max_chars: int | None = None) -> None:
        self.labels = check_labels(labels)
        texts = check_inputs(inputs)
        if instruction is not None and not isinstance(instruction, str):
            raise ClassifyInputError(
                f"instruction must be a string, got {type(instruction).__name__}", "instruction")
        if instruction == "":
            raise ClassifyInputError("instruction must not be an empty string", "instruction")
        self.label_ids = [self._label_tokens(tokenizer, i, label)
                          for i, label in enumerate(self.labels)]
        system = instruction or default_instruction(self.labels)
        longest = max(len(ids) for ids in self.label_ids)
        self.prompts: list[list[int]] = []
        for i, text in enumerate(texts):
            ids = classify_prompt(tokenizer, text, system, max_chars)
            # The engine needs room for the one token each request samples.
            if len(ids) + longest + 1 > max_model_len:
                where = "input" if len(texts) == 1 else f"input[{i}]"
                raise ClassifyInputError(
                    f"{where}: the prompt has {len(ids)} tokens and the longest label "
                    f"{longest}; with one more they must fit this model's maximum context "
                    f"length of {max_model_len} tokens", "input")
            self.prompts.append(ids)
        self._scores: list[list[float | None]] = [[None] * len(self.labels) for _ in texts]
        self._left = [len(self.labels)] * len(texts)

    @staticmethod
    def _label_tokens(tokenizer: Tokenizer, index: int, label: str) -> list[int]:
        # Plain text (special-token text stays text) that follows the prompt.
        ids = tokenizer.encode_plain(label, at_start=False)
        if not ids:
            raise ClassifyInputError(f"labels[{index}] {label!r} has no tokens", "labels")
        if len(ids) > MAX_LABEL_TOKENS:
            raise ClassifyInputError(f"labels[{index}] has {len(ids)} tokens, more than the "
                                     f"{MAX_LABEL_TOKENS} a label may have", "labels")
        return ids

    @property
    def num_inputs(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        """Each input's prompt once plus every label's tokens after it."""
        per_input = sum(len(ids) for ids in self.label_ids)
        return sum(len(p) + per_input for p in self.prompts)

    def params(self, input_index: int) -> SamplingParams:
        """The engine parameters of an input's label requests: one greedy token, the logprob
        of every token from the label on, the prompt before it open to the prefix cache."""
        return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                              prompt_logprobs_start=len(self.prompts[input_index]))

    def _request(self, input_index: int, label_index: int) -> LabelRequest:
        return LabelRequest(input_index, label_index,
                            self.prompts[input_index] + self.label_ids[label_index],
                            self.params(input_index))

    def first_requests(self) -> list[LabelRequest]:
        """The first label of every input, in the order of the inputs."""
        return [self._request(i, 0) for i in range(self.num_inputs)]

    def record(self, request: LabelRequest,
               prompt_logprobs: Sequence[TokenLogprobs | None] | None) -> list[LabelRequest]:
        """Score a finished label request from its prompt logprobs; returns the requests to
        submit now: an input's other labels after its first."""
        i, j = request.input_index, request.label_index
        start = len(self.prompts[i])
        entries = list(prompt_logprobs or [])[start:len(request.token_ids)]
        if len(entries) != len(self.label_ids[j]) or any(e is None for e in entries):
            raise RuntimeError(f"the engine returned no logprobs for label {j} of input {i}")
        assert self._scores[i][j] is None, "a label is scored once"
        self._scores[i][j] = sum(e.logprob for e in entries if e is not None)
        self._left[i] -= 1
        if j != 0:
            return []
        return [self._request(i, k) for k in range(1, len(self.labels))]

    def input_done(self, input_index: int) -> bool:
        return self._left[input_index] == 0

    @property
    def done(self) -> bool:
        return not any(self._left)

    def results(self) -> list[ClassificationResult]:
        """Every input's result, in the order of the inputs; call once ``done``."""
        out = []
        per_label_tokens = sum(len(ids) for ids in self.label_ids)
        for i, scores in enumerate(self._scores):
            if any(s is None for s in scores):
                raise RuntimeError(f"input {i} is not scored yet")
            sums = [float(s) for s in scores if s is not None]
            probs = label_probs(sums)
            best = max(range(len(sums)), key=lambda k: sums[k])
            out.append(ClassificationResult(
                index=i, label=self.labels[best], probs=dict(zip(self.labels, probs, strict=True)),
                logprobs=dict(zip(self.labels, sums, strict=True)),
                num_prompt_tokens=len(self.prompts[i]) + per_label_tokens))
        return out


def run_label_scoring(engine: LLMEngine, scorer: LabelScorer,
                      id_prefix: str) -> list[ClassificationResult]:
    """Score every label with the synchronous engine (which runs nothing else meanwhile),
    whole inputs at a time up to MAX_LABEL_REQUESTS_IN_FLIGHT label requests."""
    window = max(1, MAX_LABEL_REQUESTS_IN_FLIGHT // len(scorer.labels))
    waiting = deque(scorer.first_requests())
    in_flight: dict[str, LabelRequest] = {}
    ids = itertools.count()
    open_inputs = 0

    def add(request: LabelRequest) -> None:
        rid = f"{id_prefix}-{next(ids)}"
        engine.add_request(rid, request.prompt, request.params)
        in_flight[rid] = request

    try:
        while waiting or in_flight:
            while waiting and open_inputs < window:
                add(waiting.popleft())
                open_inputs += 1
            if not engine.has_unfinished_requests():
                raise RuntimeError("the engine stopped with labels still to score")
            for out in engine.step():
                request = in_flight.pop(out.request_id, None) if out.finished else None
                if request is None:
                    continue
                for follow_up in scorer.record(request, out.prompt_logprobs):
                    add(follow_up)
                if scorer.input_done(request.input_index):
                    open_inputs -= 1
    finally:  # an error (or an interrupt) leaves nothing of this call in the engine
        for rid in in_flight:
            engine.abort_request(rid)
    return scorer.results()
