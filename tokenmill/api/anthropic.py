"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): its request
schemas, and a request turned into the chat completions request it means, so that it runs
through the same validation, chat template, tool calling and reasoning as /v1/chat/completions.

Content blocks: ``text`` everywhere; ``tool_use`` and ``thinking`` / ``redacted_thinking`` in
assistant turns (earlier thinking is not shown to the model again, as Anthropic does); and
``tool_result`` in user turns (each becomes a ``tool`` message). Any other block is a 400
naming it. ``thinking: {"type": "enabled", "budget_tokens": N}`` is the thinking budget,
``{"type": "disabled"}`` the chat template's ``enable_thinking: false``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.protocol import (
    ChatCompletionRequest,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    StrictModel,
    ToolDefinition,
)

# The error type of Anthropic's error body, by HTTP status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
# The chat request's field names that a Messages request spells differently.
_FIELD_NAMES = {"thinking_token_budget": "thinking.budget_tokens", "stop": "stop_sequences",
                "chat_template_kwargs": "thinking"}


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(StrictModel):
    """A client tool (Anthropic's server tools, such as web search, are not run here)."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ThinkingParam(StrictModel):
    """``enabled`` with a budget, ``adaptive`` (the model decides; the server's default
    budget applies) or ``disabled``."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None


class CountTokensRequest(StrictModel):
    """POST /v1/messages/count_tokens."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingParam | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # tokenmill's extension (as on /v1/chat/completions): token id -> bias.
    logit_bias: dict[str, float] | None = None


def error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error body for ``err``."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500
                            else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def renamed(err: APIError) -> APIError:
    """``err`` with the chat request's field names (in ``param`` and the message) written as
    the Messages request spells them."""
    if err.param == "tools":  # chat's tools[i].function.X is tools[i].X here
        message = err.message.replace(".function.parameters", ".input_schema")
        return APIError(err.status, message.replace(".function.", "."), param="tools",
                        code=err.code, headers=err.headers)
    name = _FIELD_NAMES.get(err.param or "")
    if name is None:
        return err
    return APIError(err.status, err.message.replace(err.param or "", name, 1), param=name,
                    code=err.code, headers=err.headers)


def _text(content: Any, where: str) -> str:
    """The text of a ``str`` or a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" \
                or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{where}[{j}].type: unsupported block type {kind!r} (only text "
                              "blocks here)", f"{where}[{j}].type")
        parts.append(block["text"])
    return "\n".join(parts)


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks as chat messages: a ``tool`` message per result, then the text."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            text = _text(block.get("content", ""), f"{at}.content")
            if block.get("is_error") is True:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": text})
        else:
            raise bad_request(f"{at}.type: unsupported block type {kind!r} in a user message "
                              "(text and tool_result are)", f"{at}.type")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """An assistant turn's blocks as one chat message with its text and tool calls."""
    texts, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise bad_request(f"{at}: a tool_use block needs an id, a name and an input "
                                  "object", at)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise bad_request(f"{at}.type: unsupported block type {kind!r} in an assistant message "
                              "(text, tool_use and thinking are)", f"{at}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat completions messages; 400 names a block it cannot take."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            out.extend(_user(message.content, where))
        else:
            out.append(_assistant(message.content, where))
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """``tool_choice`` as chat's, and whether parallel calls are allowed."""
    if choice is None:
        return None, True
    kind, parallel = choice.get("type"), not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return NamedToolChoice(function=NamedFunction(name=choice["name"])), parallel
    raise bad_request("tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                      "{\"type\": \"tool\", \"name\": ...}", "tool_choice")


def chat_request(req: CountTokensRequest, thinks: bool, max_tokens: int | None = None,
                 ) -> ChatCompletionRequest:
    """The chat completions request ``req`` means; ``thinks``: the model has a reasoning
    parser (a ``thinking`` block for a model without one is a 400)."""
    fields: dict[str, Any] = {"messages": chat_messages(req), "max_tokens": max_tokens}
    if req.tools:
        fields["tools"] = [ToolDefinition(function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.input_schema))
            for t in req.tools]
    fields["tool_choice"], fields["parallel_tool_calls"] = _tool_choice(req.tool_choice)
    if req.thinking is not None:
        if not thinks:
            raise bad_request("thinking: this model has no reasoning parser (it does not "
                              "think, or the server runs with --reasoning-parser none)",
                              "thinking")
        if req.thinking.type == "disabled":
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        elif req.thinking.type == "adaptive":
            pass
        elif req.thinking.budget_tokens is None:
            raise bad_request("thinking.budget_tokens is required when thinking is enabled",
                              "thinking.budget_tokens")
        else:
            fields["thinking_token_budget"] = req.thinking.budget_tokens
    if isinstance(req, MessagesRequest):
        fields.update(stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, logit_bias=req.logit_bias)
    return ChatCompletionRequest(**fields)
