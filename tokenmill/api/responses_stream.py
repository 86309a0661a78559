"""The answer of a Responses request, built from the engine's outputs as OpenAI's typed stream
events: the whole (non-streamed) response is the same builder's final state, so both always
agree.

Events, in OpenAI's order, each with its ``sequence_number``: response.created,
response.in_progress; for a search, the file_search_call item (output_item.added,
file_search_call.in_progress / searching / completed, output_item.done); for text, the message
item (output_item.added, content_part.added, output_text.delta..., output_text.done,
output_text.annotation.added..., content_part.done, output_item.done); for each call, a
function_call item (output_item.added, function_call_arguments.delta / done,
output_item.done); then response.completed, response.incomplete (cut by max_output_tokens) or
response.failed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tokenmill.api.chat import chat_logprobs
from tokenmill.api.file_search import CitationReader
from tokenmill.api.protocol import ChatTokenLogprob
from tokenmill.api.response_building import TokenTexts, usage_info
from tokenmill.api.responses_api import ResponsesCall
from tokenmill.api.responses_protocol import (
    FileSearchCall,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from tokenmill.outputs import ComputeUsage, RequestOutput

# One stream event: its "type", "sequence_number" and the fields of that type.
Event = dict[str, Any]


def item_id(prefix: str) -> str:
    """An output item id in OpenAI's shape (``msg_...``, ``fs_...``, ``fc_...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


@dataclass
class _OpenMessage:
    """The message item being written: where it is in ``output``, its text so far."""

    index: int
    item: OutputMessage
    text: list[str] = field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)


@dataclass
class ResponseBuilder:
    """Builds one response from its engine outputs: ``start``, ``feed`` per output,
    ``finish`` (or ``fail``); each returns the events to send, and ``response`` is the
    object as it stands."""

    call: ResponsesCall
    response: ResponseObject
    seq: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    compute: ComputeUsage | None = None
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    _message: _OpenMessage | None = None
    _citations: CitationReader | None = None
    # The reasoning item being written: its index in ``output``, its text so far.
    _thinking: tuple[int, ReasoningItem, list[str]] | None = None

    def __post_init__(self) -> None:
        if self.call.sources:
            self._citations = CitationReader(self.call.sources)
        self._texts = TokenTexts(self.call.chat.tokenizer)

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _lifecycle(self, kind: str) -> Event:
        return self._event(kind, response=_dump(self.response))

    # ------------------------------------------------------------------ the start

    def start(self) -> list[Event]:
        """response.created, response.in_progress, and the search the server ran."""
        events = [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]
        results, query = self.call.results, self.call.plan.query
        if results is None or query is None:
            return events
        item = FileSearchCall(id=item_id("fs"), status="in_progress", queries=[query])
        index = len(self.response.output)
        self.response.output.append(item)
        at = {"item_id": item.id, "output_index": index}
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=_dump(item)))
        for phase in ("in_progress", "searching", "completed"):
            events.append(self._event(f"response.file_search_call.{phase}", **at))
        item.status = "completed"
        if "file_search_call.results" in self.call.plan.includes:
            item.results = results
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=_dump(item)))
        return events

    # ------------------------------------------------------------------ the outputs

    def feed(self, out: RequestOutput) -> list[Event]:
        """The events of one engine output (DELTA): text deltas and finished calls."""
        events: list[Event] = []
        self.input_tokens = len(out.prompt_token_ids)
        self.compute = out.metrics.usage.copy()
        self.cached_tokens = out.metrics.num_cached_tokens
        for c in out.outputs:
            self.output_tokens += len(c.token_ids)
            if c.finished:
                self.finish_reason = c.finish_reason
            lps = self._logprobs(c.logprobs or [])
            content, calls = c.text, []
            thinker = self.call.chat.reasoning
            if thinker is not None:  # a reasoning model: its thinking first, as an item
                thinker.observe(c.index, c.token_ids)
                thinking, content = thinker.delta(c.index, c.text, c.finished)
                events += self._reasoning(thinking)
                if content or c.finished:
                    events += self._close_reasoning()
            reader = self.call.chat.tools
            if reader is not None:
                delta, _ = reader.delta(c.index, content, c.finished, c.finish_reason)
                content = (delta.content or "") if delta is not None else ""
                calls = [(d.id or "", d.function.name or "", d.function.arguments or "")
                         for d in (delta.tool_calls if delta is not None else None) or []
                         if d.function is not None]
            events += self._text(content, lps)
            for call_id, name, arguments in calls:
                events += self._close_message()
                events += self._function_call(call_id, name, arguments)
        return events

    def _reasoning(self, text: str) -> list[Event]:
        """The reasoning item's next text (the item opened first if it is not yet)."""
        if not text:
            return []
        events: list[Event] = []
        if self._thinking is None:
            item = ReasoningItem(id=item_id("rs"))
            self._thinking = (len(self.response.output), item, [])
            self.response.output.append(item)
            events.append(self._event("response.output_item.added",
                                      output_index=self._thinking[0], item=_dump(item)))
        index, item, parts = self._thinking
        parts.append(text)
        events.append(self._event("response.reasoning_text.delta", item_id=item.id,
                                  output_index=index, content_index=0, delta=text))
        return events

    def _close_reasoning(self) -> list[Event]:
        if self._thinking is None:
            return []
        index, item, parts = self._thinking
        self._thinking = None
        text = "".join(parts)
        item.content, item.status = [ReasoningText(text=text)], "completed"
        return [self._event("response.reasoning_text.done", item_id=item.id,
                            output_index=index, content_index=0, text=text),
                self._event("response.output_item.done", output_index=index,
                            item=_dump(item))]

    def _logprobs(self, lps: list[Any]) -> list[ChatTokenLogprob]:
        k = self.call.logprobs
        if k is None or not lps:
            return []
        return chat_logprobs(lps, k, self._texts).content or []

    def _text(self, text: str, lps: list[ChatTokenLogprob]) -> list[Event]:
        if self._citations is not None:
            text = self._citations.feed(text)
        if not text and not lps:
            return []
        events = self._open_message()
        msg = self._message
        assert msg is not None
        msg.text.append(text)
        msg.logprobs.extend(lps)
        events.append(self._event("response.output_text.delta", item_id=msg.item.id,
                                  output_index=msg.index, content_index=0, delta=text,
                                  logprobs=[_dump(lp) for lp in lps]))
        return events

    def _open_message(self) -> list[Event]:
        if self._message is not None:
            return []
        item = OutputMessage(id=item_id("msg"), status="in_progress")
        index = len(self.response.output)
        self.response.output.append(item)
        self._message = _OpenMessage(index, item)
        part = OutputText(text="", logprobs=[] if self.call.logprobs is not None else None)
        return [self._event("response.output_item.added", output_index=index,
                            item=_dump(item)),
                self._event("response.content_part.added", item_id=item.id,
                            output_index=index, content_index=0, part=_dump(part))]

    def _close_message(self, status: str = "completed") -> list[Event]:
        msg = self._message
        if msg is None:
            return []
        self._message = None
        text = "".join(msg.text)
        annotations = self._citations.annotations(len(text)) if self._citations else []
        part = OutputText(text=text, annotations=annotations,
                          logprobs=msg.logprobs if self.call.logprobs is not None else None)
        at = {"item_id": msg.item.id, "output_index": msg.index, "content_index": 0}
        events = [self._event("response.output_text.done", **at, text=text,
                              logprobs=[_dump(lp) for lp in msg.logprobs])]
        for i, annotation in enumerate(annotations):
            events.append(self._event("response.output_text.annotation.added", **at,
                                      annotation_index=i, annotation=_dump(annotation)))
        msg.item.content = [part]
        msg.item.status = status  # type: ignore[assignment]
        events.append(self._event("response.content_part.done", **at, part=_dump(part)))
        events.append(self._event("response.output_item.done", output_index=msg.index,
                                  item=_dump(msg.item)))
        return events

    def _function_call(self, call_id: str, name: str, arguments: str) -> list[Event]:
        item = FunctionCallItem(id=item_id("fc"), call_id=call_id, name=name, arguments="",
                                status="in_progress")
        index = len(self.response.output)
        at = {"item_id": item.id, "output_index": index}
        events = [self._event("response.output_item.added", output_index=index,
                              item=_dump(item)),
                  self._event("response.function_call_arguments.delta", **at,
                              delta=arguments),
                  self._event("response.function_call_arguments.done", **at,
                              arguments=arguments)]
        item.arguments, item.status = arguments, "completed"
        self.response.output.append(item)
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=_dump(item)))
        return events

    # ------------------------------------------------------------------ the end

    def _usage(self) -> ResponseUsage:
        # Chat's usage_info rounds the compute figures; the same numbers here.
        info = usage_info(self.input_tokens, self.output_tokens, self.compute)
        thinker = self.call.chat.reasoning
        return ResponseUsage(input_tokens=self.input_tokens, output_tokens=self.output_tokens,
                             output_tokens_details=OutputTokensDetails(reasoning_tokens=(
                                 thinker.streamed_count if thinker is not None else 0)),
                             total_tokens=info.total_tokens,
                             input_tokens_details=InputTokensDetails(
                                 cached_tokens=self.cached_tokens or 0),
                             compute_seconds=info.compute_seconds,
                             energy_joules=info.energy_joules,
                             energy_estimated=info.energy_estimated, cost_usd=info.cost_usd)

    def finish(self) -> list[Event]:
        """Close the open item and end the response: completed, incomplete when the answer
        was cut by max_output_tokens (or the context's end), failed when it was aborted."""
        events: list[Event] = []
        if self._citations is not None:
            events += self._text(self._citations.finish(), [])
        events += self._close_reasoning()
        cut = self.finish_reason == "length"
        has_answer = any(item.type not in ("file_search_call", "reasoning")
                         for item in self.response.output)
        if not has_answer and self._message is None:
            events += self._open_message()  # an empty answer is still a message
        events += self._close_message("incomplete" if cut else "completed")
        self.response.usage = self._usage()
        if self.finish_reason == "abort":
            return events + self.fail("the request was aborted (the server is shutting down)")
        if cut:
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            return [*events, self._lifecycle("response.incomplete")]
        self.response.status = "completed"
        return [*events, self._lifecycle("response.completed")]

    def fail(self, message: str, code: str = "server_error") -> list[Event]:
        """End the response as failed (the engine died under it)."""
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        return [self._lifecycle("response.failed")]
