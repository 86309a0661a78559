"""Anthropic's Messages API answers: the whole ``message`` object, and the streamed event
sequence (``message_start``, per block ``content_block_start`` / ``content_block_delta`` /
``content_block_stop``, ``message_delta`` with the stop reason and usage, ``message_stop``),
both built from what the chat completions path makes of the engine's outputs."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenmill.api.anthropic import CountTokensRequest, chat_request
from tokenmill.api.chat import ChatChunks, render_prompt
from tokenmill.api.errors import loads_json
from tokenmill.api.protocol import ChatChoice, ChatCompletionResponse, DeltaMessage
from tokenmill.api.reasoning import ReasoningSetup, resolve_reasoning_parser
from tokenmill.api.reasoning_request import check_template_switch
from tokenmill.api.tool_parsers import resolve_parser
from tokenmill.api.tools import check_tools
from tokenmill.api.validation import ServedModel
from tokenmill.outputs import RequestOutput

# Chat's finish reasons as Anthropic's stop reasons (a stop string is "stop_sequence").
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "abort": "end_turn"}


def message_id() -> str:
    """An id in Anthropic's shape."""
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str | None) -> str:
    """A chat tool call's id in Anthropic's shape (``toolu_...``)."""
    return "toolu_" + (call_id or uuid.uuid4().hex[:24]).removeprefix("call_")


def stop_reason(finish_reason: str | None, stop: int | str | None) -> tuple[str | None,
                                                                          str | None]:
    """``(stop_reason, stop_sequence)`` of a chat choice's finish."""
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return _STOP_REASONS.get(finish_reason or "", finish_reason), None


def _input(arguments: str) -> Any:
    try:
        return loads_json(arguments or "{}")
    except ValueError:  # a call cut short by max_tokens: its text, as Anthropic's SDK would
        return {"_raw": arguments}


def content_blocks(choice: ChatChoice) -> list[dict[str, Any]]:
    """A whole answer's blocks: its thinking, its text, then its tool calls."""
    message, blocks = choice.message, []
    if message.reasoning_content is not None:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content,
                       "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls or []:
        blocks.append({"type": "tool_use", "id": tool_use_id(call.id),
                       "name": call.function.name, "input": _input(call.function.arguments)})
    return blocks


def message(resp: ChatCompletionResponse, model: str, mid: str) -> dict[str, Any]:
    """The Messages API's answer of a whole chat response (one choice)."""
    choice = resp.choices[0]
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(choice), "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": resp.usage.prompt_tokens,
                      "output_tokens": resp.usage.completion_tokens}}


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event of Anthropic's stream."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


@dataclass
class MessageEvents:
    """The streamed events of one answer, from the chat chunks of its engine outputs."""

    chunks: ChatChunks
    model: str
    mid: str
    input_tokens: int
    _block: str | None = None  # the open block's kind
    _index: int = -1  # its index
    _reason: tuple[str | None, str | None] = (None, None)
    _tools: dict[int, int] = field(default_factory=dict)  # chat call index -> block index

    def opening(self) -> list[str]:
        """``message_start``, with an empty message."""
        return [event("message_start", {"message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}})]

    def feed(self, out: RequestOutput) -> list[str]:
        """The events of one engine output."""
        chunk = self.chunks.delta(0, out)
        events: list[str] = []
        for choice in chunk.choices if chunk is not None else []:
            events += self._delta(choice.delta)
            if choice.finish_reason is not None:
                self._reason = stop_reason(choice.finish_reason, choice.stop_reason)
        return events

    def closing(self, output_tokens: int) -> list[str]:
        """The last block's end, the stop reason and usage, and ``message_stop``."""
        reason, sequence = self._reason
        return [*self._close(), event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": output_tokens}}), event("message_stop", {})]

    def _delta(self, delta: DeltaMessage) -> list[str]:
        events: list[str] = []
        if delta.reasoning_content:
            events += self._open("thinking", {"type": "thinking", "thinking": "",
                                              "signature": ""})
            events.append(self._piece({"type": "thinking_delta",
                                       "thinking": delta.reasoning_content}))
        if delta.content:
            events += self._open("text", {"type": "text", "text": ""})
            events.append(self._piece({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            if call.id is not None and call.function is not None:
                events += self._close()
                events += self._open(f"tool_use:{call.index}", {
                    "type": "tool_use", "id": tool_use_id(call.id),
                    "name": call.function.name, "input": {}})
            arguments = call.function.arguments if call.function is not None else None
            if arguments:
                events.append(self._piece({"type": "input_json_delta",
                                           "partial_json": arguments}))
        return events

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        """Start a block of ``kind`` unless it is the open one."""
        if self._block == kind:
            return []
        events = self._close()
        self._block, self._index = kind, self._index + 1
        return [*events, event("content_block_start", {"index": self._index,
                                                       "content_block": block})]

    def _piece(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self._index, "delta": delta})

    def _close(self) -> list[str]:
        if self._block is None:
            return []
        self._block = None
        return [event("content_block_stop", {"index": self._index})]


def count_tokens(req: CountTokensRequest, served: ServedModel, tool_call_parser: str,
                 reasoning: ReasoningSetup) -> int:
    """The prompt tokens of a Messages request (its rendered conversation and tools)."""
    tokenizer = served.tokenizer
    parser = resolve_reasoning_parser(reasoning.parser, tokenizer.chat_template)
    chat = chat_request(req, parser is not None)
    check_template_switch(chat.chat_template_kwargs, parser, tokenizer.chat_template)
    tools = (check_tools(chat), resolve_parser(tool_call_parser, tokenizer.chat_template))
    return len(render_prompt(tokenizer, chat, served.max_model_len, tools)[1])
