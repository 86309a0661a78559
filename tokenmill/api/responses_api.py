"""POST /v1/responses (OpenAI's Responses API) on top of chat completions: the request is
checked (``plan_response``), the file_search results are put into the system part of the
prompt, and the rest goes through chat's own preparation (``prepare_response``): its chat
template, tool calling, structured outputs and limits. The answer is built by
api/responses_stream.py, whole or as typed events.

The search runs between the two steps, in the server: retrieval is a layer above this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.api.chat import ChatCall, logprobs_k, prepare_chat, render_prompt
from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.file_search import NO_SOURCES, Source, fit_sources, sources_block
from tokenmill.api.protocol import (
    ChatCompletionRequest,
    JSONSchemaFormat,
    ResponseFormat,
)
from tokenmill.api.reasoning import ReasoningSetup
from tokenmill.api.responses_input import (
    Message,
    ResponseTools,
    call_ids,
    check_include,
    check_metadata,
    check_tools,
    input_messages,
    last_user_text,
)
from tokenmill.api.responses_protocol import FileSearchResult, ResponseObject, ResponsesRequest
from tokenmill.api.tool_parsers import resolve_parser
from tokenmill.api.tools import check_tools as check_chat_tools
from tokenmill.api.validation import ServedModel
from tokenmill.sampling_params import MAX_LOGPROBS

# Tokens kept free for the answer when sources are fitted and max_output_tokens is not set
# (at most a quarter of the context).
DEFAULT_ANSWER_TOKENS = 256
# Tokens kept free beyond the measured prompt: the sources' entries are counted one by one,
# and a text's tokens can differ a little where pieces meet.
SOURCE_MARGIN_TOKENS = 16

# Chat's field names in its 400s, and what the Responses API calls them.
_FIELDS = {"max_completion_tokens": "max_output_tokens", "response_format": "text",
           "messages": "input", "reasoning_effort": "reasoning.effort"}


@dataclass(frozen=True)
class ResponsePlan:
    """A request checked, before the search: the conversation as chat messages (earlier
    turns of ``previous_response_id`` first), its tools, what ``include`` adds, and the
    question to search with (None: no search)."""

    req: ResponsesRequest
    messages: list[Message]
    tools: ResponseTools
    includes: frozenset[str]
    query: str | None


def plan_response(req: ResponsesRequest, history: list[Message]) -> ResponsePlan:
    """Check what needs no model: input items, tools, tool_choice, include, metadata. 400
    names the field. ``history``: the stored conversation ``previous_response_id`` names."""
    if req.background:
        raise bad_request("background responses are not supported", "background")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                          f"{req.top_logprobs}", "top_logprobs")
    check_metadata(req.metadata)
    includes = check_include(req.include)
    tools = check_tools(req.tools, req.tool_choice)
    messages = history + input_messages(req.input, call_ids(history))
    query = last_user_text(messages) if tools.search else None
    return ResponsePlan(req, messages, tools, includes, query)


@dataclass
class ResponsesCall:
    """A prepared Responses request: chat's call (engine prompt, sampling parameters, the
    tool-call reader), the search the server ran and the sources that went into the prompt,
    and the conversation to store for a later ``previous_response_id``."""

    plan: ResponsePlan
    chat: ChatCall
    results: list[FileSearchResult] | None
    sources: list[Source]
    history: list[Message] = field(default_factory=list)

    @property
    def req(self) -> ResponsesRequest:
        return self.plan.req

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token the output text's logprobs carry; None: no logprobs."""
        return logprobs_k(self.chat.req)

    def skeleton(self, rid: str, model: str, created_at: int) -> ResponseObject:
        """The response object before any output: the request's settings echoed back."""
        req = self.req
        fmt = req.text.format if req.text else None
        text = fmt.model_dump(by_alias=True, exclude_none=True) \
            if fmt is not None and fmt.type != "text" else {"type": "text"}
        return ResponseObject(
            id=rid, created_at=created_at, status="in_progress", model=model,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, text={"format": text},
            tool_choice=req.tool_choice or "auto", tools=list(req.tools or []), user=req.user,
            metadata=dict(req.metadata or {}), store=req.store)


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise bad_request("text.format of type json_schema needs schema", "text")
    return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(**{
        "name": fmt.name, "description": fmt.description, "schema": fmt.json_schema,
        "strict": fmt.strict}))


def _with_system(messages: list[Message], parts: list[str]) -> list[Message]:
    """``messages`` with ``parts`` and the leading system messages joined into one system
    message at the start (templates take one system turn, first)."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    text = "\n\n".join(p for p in [*parts[:1], *(m["content"] for m in messages[:lead]),
                                   *parts[1:]] if p)
    rest = messages[lead:]
    return [{"role": "system", "content": text}, *rest] if text else rest


def _chat_request(plan: ResponsePlan, messages: list[Message]) -> ChatCompletionRequest:
    req, tools = plan.req, plan.tools
    logprobs = "message.output_text.logprobs" in plan.includes
    return ChatCompletionRequest(
        messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, user=req.user,
        logprobs=logprobs, top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        tools=tools.functions or None, tool_choice=tools.chat_choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req),
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None)


def _responses_error(e: APIError) -> APIError:
    """A 400 of chat's preparation, naming the Responses API's fields instead of chat's."""
    message, param = e.message, e.param
    for chat_name, name in _FIELDS.items():
        message = message.replace(chat_name, name)
    return APIError(e.status, message, param=_FIELDS.get(param or "", param), code=e.code,
                    headers=e.headers)


def _source_budget(plan: ResponsePlan, served: ServedModel, parts: list[str],
                   tool_call_parser: str) -> int:
    """Tokens the sources may take: the context less the prompt without them and the room
    kept for the answer."""
    messages = _with_system(plan.messages, [*parts, NO_SOURCES])
    chat_req = _chat_request(plan, messages)
    setup = check_chat_tools(chat_req)
    parser = resolve_parser(tool_call_parser, served.tokenizer.chat_template)
    _, ids = render_prompt(served.tokenizer, chat_req, served.max_model_len, (setup, parser))
    max_len = served.max_model_len
    answer = plan.req.max_output_tokens or min(DEFAULT_ANSWER_TOKENS, max_len // 4)
    return max_len - len(ids) - answer - SOURCE_MARGIN_TOKENS


def prepare_response(plan: ResponsePlan, served: ServedModel,
                     results: list[FileSearchResult] | None,
                     tool_call_parser: str = "auto",
                     reasoning: ReasoningSetup | None = None) -> ResponsesCall:
    """The engine prompt and sampling parameters of a planned request, with the search's
    ``results`` (None: no search ran) fitted into the system part of the prompt; 400 names
    the Responses API's field."""
    parts = [plan.req.instructions or ""]
    sources: list[Source] = []
    try:
        if results is not None:
            budget = _source_budget(plan, served, parts, tool_call_parser)
            sources = fit_sources(results, served.tokenizer, budget)
            parts.append(sources_block(sources))
        messages = _with_system(plan.messages, parts)
        chat = prepare_chat(_chat_request(plan, messages), served, tool_call_parser,
                            reasoning)
        if chat.tools is not None:  # a function_call item is written whole
            chat.tools.whole_calls = True
    except APIError as e:
        raise _responses_error(e) from None
    return ResponsesCall(plan, chat, results, sources, list(plan.messages))


def conversation(call: ResponsesCall, response: ResponseObject) -> list[Message]:
    """The conversation to store: the turns so far and the answer (its text and its calls),
    for a later request's ``previous_response_id``."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    calls = []
    for item in response.output:
        if item.type == "message":
            turn["content"] += "".join(part.text for part in item.content)
        elif item.type == "function_call":
            calls.append({"id": item.call_id, "type": "function",
                          "function": {"name": item.name, "arguments": item.arguments}})
    if calls:
        turn["tool_calls"] = calls
        turn["content"] = turn["content"] or None
    return [*call.history, turn]
