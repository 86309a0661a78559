"""The Responses API's request fields checked and turned into what chat completions takes:
``input`` items into chat messages, ``tools`` into function tools plus at most one file_search
tool, ``tool_choice``, ``include`` and ``metadata``. Every refusal is a 400 naming the field
(``input[2].content[0].type``), as OpenAI's are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from tokenmill.api.errors import bad_request
from tokenmill.api.protocol import (
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolDefinition,
)
from tokenmill.api.responses_protocol import FileSearchTool, FunctionTool

# A chat message as the chat template takes it (see chat_template.validate_messages).
Message = dict[str, Any]

# Roles of input messages; developer is OpenAI's newer name for system.
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Text parts by role: what a user/system turn and an assistant turn may hold.
_TEXT_PARTS = {"input_text", "output_text", "text"}
# Everything OpenAI's ``include`` may name; the ones tokenmill fills are SUPPORTED_INCLUDES.
KNOWN_INCLUDES = frozenset({
    "file_search_call.results", "message.output_text.logprobs", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content"})
SUPPORTED_INCLUDES = frozenset({"file_search_call.results", "message.output_text.logprobs"})
# OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def _text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string, or a list of text parts (concatenated)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}[{j}].type {kind!r} is not supported: this model takes "
                              "text only (input_text)", "input")
        else:
            raise bad_request(f"{where}[{j}] must be {{\"type\": \"input_text\", \"text\": "
                              f"<string>}}, got type {kind!r}", "input")
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string, got {type(value).__name__}", "input")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` input item as one entry of a chat message's ``tool_calls``."""
    return {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where),
                         "arguments": _string(item, "arguments", where)}}


def input_messages(value: str | list[Any], calls_before: set[str] | None = None) -> list[Message]:
    """``input`` as chat messages: a string is one user message; items are messages (roles
    user, system, developer, assistant), ``function_call`` items (the assistant's earlier
    calls, merged into its turn) and ``function_call_output`` items (tool messages, each
    answering a call made before it); ``file_search_call`` items, the record of an earlier
    search, are skipped. ``calls_before``: call ids of earlier turns (previous_response_id)."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be empty", "input")
        return [{"role": "user", "content": value}]
    if not value:
        raise bad_request("input must not be an empty list", "input")
    messages: list[Message] = []
    calls = set(calls_before or ())
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object, got {type(item).__name__}", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise bad_request(f"{where}: no function_call with call_id {call_id!r} comes "
                                  "before this output", "input")
            output = _text_of(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind not in ("file_search_call", "reasoning"):  # earlier thinking: not re-read
            raise bad_request(f"{where}.type {kind!r} is not supported (message, "
                              "function_call, function_call_output)", "input")
    if not messages:
        raise bad_request("input holds no message", "input")
    return messages


def _message(item: dict[str, Any], where: str) -> Message:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of user, system, developer, assistant, "
                          f"got {role!r}", "input")
    return {"role": _ROLES[role], "content": _text_of(item.get("content"), f"{where}.content")}


def call_ids(messages: list[Message]) -> set[str]:
    """The ids of the calls the assistant made in ``messages``."""
    return {c["id"] for m in messages for c in m.get("tool_calls") or ()}


def last_user_text(messages: list[Message]) -> str | None:
    """The latest user message's text: the question file_search searches with."""
    for message in reversed(messages):
        if message["role"] == "user" and message["content"].strip():
            return message["content"]
    return None


# ----------------------------------------------------------------------------- tools


@dataclass(frozen=True)
class ResponseTools:
    """A request's tools, checked: the functions (as chat's tool definitions), the file_search
    tool if any, and chat's ``tool_choice``; ``search``: whether the server searches."""

    functions: list[ToolDefinition]
    file_search: FileSearchTool | None
    chat_choice: str | NamedToolChoice | None
    search: bool


def _validated(model: type[BaseModel], item: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(item)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise bad_request(f"{where}.{loc}: {err['msg']}", "tools") from None


def check_tools(tools: list[Any] | None,
                tool_choice: str | dict[str, Any] | None) -> ResponseTools:
    """``tools`` and ``tool_choice`` checked; 400 for an unknown tool type, a second
    file_search tool, or a choice naming a tool that is not there."""
    functions: list[ToolDefinition] = []
    file_search: FileSearchTool | None = None
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        where = f"tools[{i}]"
        if kind == "function":
            f = _validated(FunctionTool, tool, where)
            functions.append(ToolDefinition(function=FunctionDefinition(
                name=f.name, description=f.description, parameters=f.parameters,
                strict=f.strict)))
        elif kind == "file_search":
            if file_search is not None:
                raise bad_request(f"{where}: only one file_search tool may be given", "tools")
            file_search = _validated(FileSearchTool, tool, where)
            if not file_search.vector_store_ids:
                raise bad_request(f"{where}.vector_store_ids must name at least one vector "
                                  "store", "tools")
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported (function, "
                              "file_search)", "tools")
    return _choice(tool_choice, functions, file_search)


def _choice(choice: str | dict[str, Any] | None, functions: list[ToolDefinition],
            file_search: FileSearchTool | None) -> ResponseTools:
    """chat's tool_choice and whether to search, from the Responses API's ``tool_choice``:
    "none" | "auto" | "required" | {"type": "function", "name"} | {"type": "file_search"}."""
    names = {t.function.name for t in functions}
    if choice is None or choice == "auto":
        return ResponseTools(functions, file_search, None, file_search is not None)
    if choice == "none":
        return ResponseTools(functions, file_search, "none", False)
    if choice == "required":
        if not functions and file_search is None:
            raise bad_request("tool_choice \"required\" needs tools", "tool_choice")
        # A search the server always runs is the required call when there are no functions.
        return ResponseTools(functions, file_search, "required" if functions else None,
                             file_search is not None)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools",
                              "tool_choice")
        named = NamedToolChoice(function=NamedFunction(name=name))
        return ResponseTools(functions, file_search, named, False)
    if isinstance(choice, dict) and choice.get("type") == "file_search":
        if file_search is None:
            raise bad_request("tool_choice names file_search, which is not in tools",
                              "tool_choice")
        return ResponseTools(functions, file_search, "none", True)
    raise bad_request("tool_choice must be \"none\", \"auto\", \"required\", {\"type\": "
                      "\"function\", \"name\": ...} or {\"type\": \"file_search\"}, got "
                      f"{choice!r}", "tool_choice")


def check_include(include: list[str] | None) -> frozenset[str]:
    """``include``, checked against OpenAI's values; the ones that name something tokenmill
    does not produce (web search, images, reasoning) are accepted and have nothing to add."""
    for i, value in enumerate(include or []):
        if value not in KNOWN_INCLUDES:
            raise bad_request(f"include[{i}] {value!r} is not one of "
                              f"{', '.join(sorted(KNOWN_INCLUDES))}", "include")
    return frozenset(include or ()) & SUPPORTED_INCLUDES


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits on ``metadata``: 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs, got "
                          f"{len(metadata)}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata keys may be {MAX_METADATA_KEY} characters and values "
                              f"{MAX_METADATA_VALUE}; {key[:70]!r} is over", "metadata")
