"""A chat request's thinking controls checked and applied: the template switch
(``chat_template_kwargs.enable_thinking``) and the thinking budget, shared by
/v1/chat/completions and Anthropic's /v1/messages (see api/reasoning.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenmill.api.errors import bad_request
from tokenmill.api.reasoning import (
    ReasoningParser,
    ReasoningReader,
    reasoning_reader,
    thinking_budget,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer


def check_template_switch(kwargs: dict[str, Any] | None, parser: ReasoningParser | None,
                          template: str | None) -> None:
    """400 on ``chat_template_kwargs`` when it turns thinking on or off for a model that has
    no thinking (no reasoning parser, and a template that reads no ``enable_thinking``)."""
    if not kwargs or "enable_thinking" not in kwargs:
        return
    if not isinstance(kwargs["enable_thinking"], bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be a boolean",
                          "chat_template_kwargs")
    if parser is None and "enable_thinking" not in (template or ""):
        raise bad_request("chat_template_kwargs.enable_thinking: this model does not think "
                          "(its chat template has no thinking switch)", "chat_template_kwargs")


def check_effort(effort: str | None, parser: ReasoningParser | None,
                 template: str | None) -> None:
    """400 on ``reasoning_effort`` for a model that does not think (no reasoning parser, and
    a template that reads no ``reasoning_effort``)."""
    if effort is not None and parser is None and "reasoning_effort" not in (template or ""):
        raise bad_request("reasoning_effort: this model does not think (no reasoning parser, "
                          "and its chat template reads no reasoning_effort)", "reasoning_effort")


def requested_budget(budgets: dict[str, int | None]) -> tuple[str, int] | None:
    """The one budget field set among ``budgets`` (name -> value), or None; 400 when more
    than one is set or one is not an integer."""
    given = [(name, value) for name, value in budgets.items() if value is not None]
    if len(given) > 1:
        raise bad_request(f"set only one of {', '.join(n for n, _ in given)}", given[1][0])
    if given and (isinstance(given[0][1], bool) or not isinstance(given[0][1], int)):
        raise bad_request(f"{given[0][0]} must be an integer", given[0][0])
    return given[0] if given else None


def apply_reasoning(parser: ReasoningParser | None, budget: tuple[str, int] | None,
                    default_budget: int | None, prompt: str, tokenizer: Tokenizer,
                    params: SamplingParams) -> tuple[ReasoningReader | None, SamplingParams]:
    """The reader of the outputs' thinking and the sampling parameters with the thinking
    budget (``budget``: the request's field and value; else ``default_budget``, the
    server's). 400 naming the field: a budget for a model without a reasoning parser, below
    0 or above max_tokens, with beam search, or one the model's vocabulary cannot count."""
    if parser is None:
        if budget is not None:
            raise bad_request(f"{budget[0]}: this model has no reasoning parser (start the "
                              "server with --reasoning-parser)", budget[0])
        return None, params
    reader = reasoning_reader(parser, prompt, tokenizer)
    if parser.special_markup and params.skip_special_tokens:
        params = replace(params, skip_special_tokens=False)  # the parser takes them out
    if params.structured_outputs is not None:
        # The constraint (a schema, a forced tool call...) holds from the first token, even
        # where the template opened the thinking: what the model writes is the answer.
        reader.inside = False
    name, value = budget if budget is not None else ("max_thinking_tokens", default_budget)
    if value is None:
        return reader, params
    if value < 0:
        raise bad_request(f"{name} must be >= 0, got {value}", name)
    if params.max_tokens is not None and value > params.max_tokens:
        if budget is None:  # the server's default fits the request's own limit
            value = params.max_tokens
        else:
            raise bad_request(f"{name} must be at most max_tokens ({params.max_tokens}), "
                              f"got {value}", name)
    if params.use_beam_search or params.structured_outputs is not None:
        if budget is None:  # the server's default gives way to the request's constraint
            return reader, params
        raise bad_request(f"{name} cannot be combined with use_beam_search or an output "
                          "constraint (response_format, structured_outputs, a forced tool "
                          "call)", name)
    try:
        limit = thinking_budget(parser, tokenizer, value, reader.inside)
    except ValueError as e:
        raise bad_request(f"{name}: {e}", name) from None
    return reader, replace(params, thinking_budget=limit)
