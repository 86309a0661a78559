"""What chat and completions requests share: the model they name, their sampling parameters,
and the limits a prompt must keep (context length, vocabulary). Every refusal is a 400 (or 404)
that names the field."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokenmill.request import ContextOverflow, context_overflow, first_invalid_token_id
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer


class ModelFacts(Protocol):
    """What validating any request needs of the model (an LLMEngine or an AsyncLLM)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...


class ServedModel(ModelFacts, Protocol):
    """What validating a generation request needs of the model."""

    def compile_grammar(self, params: SamplingParams) -> object | None: ...


def default_model_name(path: str) -> str:
    """The default served name: the model file's or folder's name without its extension."""
    base = os.path.basename(os.path.normpath(path))
    return base.removesuffix(".gguf")


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out = {}
    for key, bias in raw.items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None
    return out


def sampling_params(req: SamplingFields, vocab_size: int, *, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams, validated against the vocabulary; 400 names the field."""
    try:
        params = SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias), stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens, speculative=req.speculative,
            structured_outputs=structured_outputs(req), use_beam_search=req.use_beam_search,
            length_penalty=req.length_penalty, early_stopping=req.early_stopping,
            priority=req.priority)
        params.validate(vocab_size=vocab_size)
    except ValueError as e:
        message, param = str(e), _param_of(str(e))
        if param == "structured_outputs":  # name the field the client set the constraint by
            param = _constraint_field(req)
            message = message.replace("structured_outputs", param, 1)
        elif param == "prompt_logprobs" and getattr(req, "echo", False):
            param = "echo"  # completions ask for the prompt's logprobs by echo and logprobs
        raise bad_request(message, param) from None
    return params


def beam_max_tokens(req: SamplingFields, max_tokens: int | None, prompt_lens: Sequence[int],
                    max_model_len: int) -> int | None:
    """``max_tokens``, or for a beam search that sets none, the room the shortest prompt
    leaves in the context: beams need a length limit, and vLLM's server defaults it so (the
    engine caps each longer prompt's beams at the context)."""
    if max_tokens is not None or not req.use_beam_search:
        return max_tokens
    return max_model_len - min(prompt_lens)


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint from whichever field sets it: OpenAI's
    ``response_format``, vLLM's ``structured_outputs`` or its ``guided_*`` fields (at most one
    of them); 400 names the field."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              "response_format")
        found.append(("response_format", {"json": rf.json_schema.json_schema}))
    so = req.structured_outputs
    if so is not None:
        fields = {"json": so.json_, "json_object": so.json_object or None, "regex": so.regex,
                  "choice": so.choice, "grammar": so.grammar}
        found.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}
                      | {"any_whitespace": so.any_whitespace}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"a request may set one output constraint, got {names}", found[1][0])
    name, fields = found[0]
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise bad_request(str(e).replace("structured_outputs", name, 1), name) from None


def _constraint_field(req: SamplingFields) -> str:
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            return name
    return "structured_outputs"


def check_grammar(req: SamplingFields, params: SamplingParams, served: ServedModel) -> None:
    """Compile the request's output constraint (cached: the engine reuses it); 400 naming the
    field when the schema, regex or grammar cannot be used or takes too long to compile."""
    if params.structured_outputs is None:
        return
    try:
        served.compile_grammar(params)
    except ValueError as e:
        field = _constraint_field(req)
        raise bad_request(str(e).replace("structured_outputs", field, 1), field) from None


def _param_of(message: str) -> str | None:
    """The field a SamplingParams error names (its messages start with the field)."""
    head = message.split(" ", 1)[0].split("[", 1)[0]
    return head if head.isidentifier() else None


# The fields of a generation request, which an engine refusal may start with.
_REQUEST_FIELDS = frozenset(ChatCompletionRequest.model_fields) | frozenset(
    CompletionRequest.model_fields)


def engine_refusal(e: ValueError) -> APIError:
    """The 400 of a request the engine refused on submission (e.g. a beam width over
    max_num_seqs), naming the request field its message starts with, if it starts with one."""
    param = _param_of(str(e))
    return bad_request(str(e), param if param in _REQUEST_FIELDS else None)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  param: str, max_tokens_param: str = "max_tokens") -> None:
    """400 when ``max_tokens`` is below 1, or when the prompt, plus the tokens asked for, does
    not fit the context; ``param`` names the prompt's field, ``max_tokens_param`` the limit's."""
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be >= 1, got {max_tokens}", max_tokens_param)
    overflow = context_overflow(prompt_len, max_tokens, max_model_len)
    if overflow is ContextOverflow.PROMPT:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, and the prompt "
            f"has {prompt_len}: it must leave room for at least one generated token", param)
    if overflow is ContextOverflow.TOTAL:
        assert max_tokens is not None
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)",
            max_tokens_param)


def check_token_ids(ids: Sequence[Any], vocab_size: int, param: str) -> None:
    """400 unless ``ids`` is not empty and every id is an integer in [0, vocab_size)."""
    if not ids:
        raise bad_request(f"{param} must not be empty", param)
    bad = first_invalid_token_id(ids, vocab_size)
    if bad is not None:
        raise bad_request(f"{param}: token id at index {bad} must be in [0, {vocab_size}), "
                          f"got {ids[bad]!r}", param)
