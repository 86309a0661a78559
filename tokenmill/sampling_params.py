"""Per-request sampling parameters, with vLLM's names and validation that names the field."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

# Bounds that keep one request from hurting the others (memory, time per step).
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LENGTH_PENALTY = 10.0
# Token counts and top_k fit the sampler's int32/int64 tensors whatever the model; the API
# bounds them further by the context length and the vocabulary.
MAX_TOKEN_COUNT = 2**31 - 1
# Seeds are what torch.Generator.manual_seed takes: 63 bits, not negative.
MAX_SEED = 2**63 - 1
# Structured outputs: the size of a schema, regex or grammar, and of a choice list.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def _check_range(name: str, value: Any, lo: float | None, hi: float | None, *, integer: bool = False,
                 lo_open: bool = False) -> None:
    _check_number(name, value, integer=integer)
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and value > hi
    if too_low or too_high:
        left = "(" if lo_open else "["
        lo_s = "-inf" if lo is None else repr(lo)
        hi_s = "inf" if hi is None else repr(hi)
        raise ValueError(f"{name} must be in {left}{lo_s}, {hi_s}], got {value!r}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match: exactly one of ``json`` (a JSON schema, as a dict or
    its text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings)
    or ``grammar`` (EBNF in xgrammar's GBNF dialect). vLLM's names.

    ``any_whitespace`` False makes JSON compact (no free whitespace between tokens), which small
    models need to not loop on whitespace; True allows any whitespace.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None and isinstance(self.choice, (list, tuple)):
            object.__setattr__(self, "choice", list(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "json_object", "regex", "choice" or "grammar"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def validate(self) -> None:
        """ValueError naming what is wrong (the constraint's own syntax is checked when it is
        compiled, see ``tokenmill.structured``)."""
        if not isinstance(self.json_object, bool) or not isinstance(self.any_whitespace, bool):
            raise ValueError("structured_outputs.json_object and any_whitespace must be booleans")
        given = [n for n in ("json", "regex", "choice", "grammar")
                 if getattr(self, n) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, "
                             f"regex, choice, grammar; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            self._validate_choice()
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} is {len(self.source)} characters; "
                             f"the limit is {MAX_GRAMMAR_CHARS}")

    def _validate_choice(self) -> None:
        choice = self.choice
        if not isinstance(choice, list) or not choice:
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if len(choice) > MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice may hold at most {MAX_CHOICES} strings, "
                             f"got {len(choice)}")
        for c in choice:
            if not isinstance(c, str) or not c:
                raise ValueError(f"structured_outputs.choice entries must be non-empty strings, "
                                 f"got {c!r}")
            if len(c) > MAX_CHOICE_CHARS:
                raise ValueError(f"structured_outputs.choice entries may have at most "
                                 f"{MAX_CHOICE_CHARS} characters, got one of {len(c)}")

    @property
    def source(self) -> str:
        """The constraint as text: what is compiled, and the key compiled grammars are cached
        by. A schema keeps its keys' order: xgrammar writes properties in the order the schema
        lists them ("reasoning" before "answer"), so two orders are two grammars."""
        if self.json is not None:
            return self.json if isinstance(self.json, str) else _json.dumps(
                self.json, ensure_ascii=False)
        if self.choice is not None:
            return _json.dumps(self.choice, ensure_ascii=False)
        return self.regex or self.grammar or ""


@dataclass(frozen=True)
class ThinkingBudget:
    """A hard limit on a reasoning model's thinking: once ``max_tokens`` tokens of thinking
    have been generated, the sampler forces ``end_token_ids`` (the end-of-thinking marker and
    whatever transition the family needs around it) and the answer follows.

    Thinking is the output between ``start_token_ids`` (one marker token, or a header of
    several such as gpt-oss's ``<|channel|>analysis<|message|>``) and the marker
    ``end_token_id`` (which ``end_token_ids`` contains); ``starts_inside``: the prompt already
    opened it (a chat template that ends the generation prompt with the start marker)."""

    max_tokens: int
    start_token_ids: tuple[int, ...]
    end_token_id: int
    end_token_ids: tuple[int, ...]
    starts_inside: bool = False

    def validate(self) -> None:
        """ValueError naming the field that is wrong."""
        _check_range("thinking_token_budget", self.max_tokens, 0, MAX_TOKEN_COUNT, integer=True)
        if not self.start_token_ids:
            raise ValueError("thinking budget: start_token_ids must not be empty")
        for tid in (*self.start_token_ids, self.end_token_id, *self.end_token_ids):
            _check_range("thinking budget token id", tid, 0, MAX_TOKEN_COUNT, integer=True)
        if self.end_token_id not in self.end_token_ids:
            raise ValueError("thinking budget: end_token_ids must contain end_token_id")


@dataclass
class SamplingParams:
    """How to sample one request's output tokens.

    temperature 0 means greedy. ``top_k`` 0 (or -1) and ``top_p`` 1 disable those filters.
    ``logprobs=k`` returns the sampled token's logprob and the top-k alternatives at each
    step; ``prompt_logprobs=k`` does the same for every prompt token after the first, or
    only from the token at index ``prompt_logprobs_start`` on (the entries before it are None):
    the prefix cache may then serve the prompt before that token, e.g. to score several
    continuations of one long prompt without computing it again.
    Logprobs are those of the model's raw distribution (before penalties and temperature).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    # False: one token per step even when the engine speculates (speculation is an engine
    # setting; this lets one request opt out, e.g. to compare or to save the draft's work).
    speculative: bool = True
    # The output must match a JSON schema, regex, choice list or grammar (None: free text).
    structured_outputs: StructuredOutputsParams | None = None
    # Beam search: ``n`` is the beam width and the ``n`` outputs are the best hypotheses,
    # best first (see tokenmill/core/beam_search.py). Hypotheses are scored by their summed
    # logprob over (generated length ** ``length_penalty``); ``early_stopping``: True stops
    # once ``n`` hypotheses are finished, False when no live beam can beat them at its
    # current length, "never" when none could at any length. Hugging Face's semantics.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # A hard limit on a reasoning model's thinking (None: it thinks until it stops itself).
    thinking_budget: ThinkingBudget | None = None
    # Scheduling priority (vLLM's `priority`): lower runs first; equal priorities run in
    # arrival order, and a waiting request may preempt a running one of a higher value.
    priority: int = 0
    # Normalised copies filled by __post_init__.
    stop_strings: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        # Container types are checked here because normalising them would raise TypeError.
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got "
                             f"{type(self.stop).__name__}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got "
                             f"{type(self.stop_token_ids).__name__}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got "
                                 f"{type(self.logit_bias).__name__}")
            self.logit_bias = dict(self.logit_bias)
        if self.thinking_budget is not None:
            # Drafts are verified without the budget's forced tokens: a budgeted request
            # decodes one token per step.
            self.speculative = False
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when the output is the argmax at every step."""
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first invalid field; ``vocab_size`` checks token ids."""
        _check_range("n", self.n, 1, MAX_N, integer=True)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        # At most the vocabulary (0 keeps every token): a larger value means nothing and
        # would not fit the sampler's int64 tensor.
        _check_range("top_k", self.top_k, 0, MAX_TOKEN_COUNT if vocab_size is None
                     else vocab_size, integer=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_range("seed", self.seed, 0, MAX_SEED, integer=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        if self.max_tokens is not None:
            _check_range("max_tokens", self.max_tokens, 1, MAX_TOKEN_COUNT, integer=True)
        _check_range("min_tokens", self.min_tokens, 0, MAX_TOKEN_COUNT, integer=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_range(name, value, 0, MAX_LOGPROBS, integer=True)
        _check_range("prompt_logprobs_start", self.prompt_logprobs_start, 0, MAX_TOKEN_COUNT,
                     integer=True)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        self._validate_stops()
        self._validate_token_ids(vocab_size)
        self._validate_beam_search()
        _check_range("priority", self.priority, -(1 << 31), (1 << 31) - 1, integer=True)
        if self.thinking_budget is not None:
            if not isinstance(self.thinking_budget, ThinkingBudget):
                raise ValueError(f"thinking_budget must be a ThinkingBudget, got "
                                 f"{type(self.thinking_budget).__name__}")
            self.thinking_budget.validate()
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(so).__name__}")
            so.validate()

    def _validate_beam_search(self) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be a boolean, got {self.use_beam_search!r}")
        _check_range("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY,
                     MAX_LENGTH_PENALTY)
        if self.early_stopping not in (True, False, "never") or not isinstance(
                self.early_stopping, (bool, str)):
            raise ValueError(f"early_stopping must be true, false or \"never\", got "
                             f"{self.early_stopping!r}")
        if not self.use_beam_search:
            return
        # Beams are ranked by the model's own logprobs, and their text ends on tokens: what
        # reshapes the distribution, samples or watches the text has no place in it.
        unsupported = {
            "structured_outputs": self.structured_outputs is not None,
            "stop": bool(self.stop_strings),
            "prompt_logprobs": self.prompt_logprobs is not None,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "logit_bias": bool(self.logit_bias),
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"{name} cannot be used with use_beam_search: beam search "
                                 "ranks beams by the model's own logprobs and returns whole "
                                 "hypotheses")
        if self.max_tokens is None:
            raise ValueError("use_beam_search needs max_tokens (the beams' length limit)")

    def _validate_stops(self) -> None:
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop_strings)}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(
                    f"each stop string may be at most {MAX_STOP_STRING_LEN} characters, "
                    f"got one of {len(s)}")

    def _validate_token_ids(self, vocab_size: int | None) -> None:
        hi = None if vocab_size is None else vocab_size - 1
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_STOP_STRINGS} ids, "
                f"got {len(self.stop_token_ids)}")
        for tid in self.stop_token_ids:
            _check_range("stop_token_ids", tid, 0, hi, integer=True)
        if self.logit_bias is None:
            return
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                f"got {len(self.logit_bias)}")
        for tid, bias in self.logit_bias.items():
            _check_range("logit_bias key", tid, 0, hi, integer=True)
            _check_range(f"logit_bias[{tid}]", bias, -100.0, 100.0)


@dataclass
class BeamSearchParams:
    """vLLM's parameters of ``LLM.beam_search``: ``beam_width`` beams, each up to
    ``max_tokens`` new tokens; ``early_stopping`` is tokenmill's (Hugging Face's meaning, see
    SamplingParams). Beams are ranked by the model's own logprobs: ``temperature`` is there
    for vLLM's signature and must be 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        """The same search as SamplingParams (``n`` beams); ValueError names a bad field."""
        _check_range("beam_width", self.beam_width, 1, MAX_N, integer=True)
        _check_number("temperature", self.temperature)
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search (beams are ranked by the "
                             f"model's own logprobs), got {self.temperature!r}")
        return SamplingParams(
            n=self.beam_width, use_beam_search=True, max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping, temperature=0.0,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=False)


@dataclass
class PoolingParams:
    """What an embedding request asks of its pooled vector, with vLLM's names.

    ``normalize``: scale to unit length (None: as the model's pooling says, which for
    sentence-transformers folders is their Normalize module and for decoders yes).
    ``dimensions``: keep the first N entries (Matryoshka), renormalised when normalising.
    ``truncate_prompt_tokens``: cut a longer input to its first N tokens (keeping the tokens
    the tokenizer adds around a text, such as BERT's [CLS] ... [SEP]); -1 cuts to the model's
    maximum length; None: a longer input is an error.
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def validate(self, hidden_size: int | None = None) -> None:
        """ValueError naming the field that is out of range."""
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        dims = self.dimensions
        if dims is not None:
            if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
                raise ValueError(f"dimensions must be a positive integer, got {dims!r}")
            if hidden_size is not None and dims > hidden_size:
                raise ValueError(f"dimensions must be at most the model's embedding size "
                                 f"{hidden_size}, got {dims}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                              or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1, got {k!r}")
