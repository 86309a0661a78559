"""Tool calling on /v1/chat/completions: the request's ``tools`` and ``tool_choice`` checked,
the tools put into the prompt, earlier calls and their results rendered for the chat template,
and the grammar that forces a call when ``tool_choice`` asks for one.

A chat template that uses ``tools`` gets them as HF templates expect; one that does not (the
embedded SmolLM2's) gets a system-prompt block describing them and the parser's call format.
Likewise a template that knows no ``tool_calls`` / ``tool`` role gets the earlier calls written
into the assistant's text and the results as a user turn, in the parser's format.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.api.errors import bad_request, loads_json
from tokenmill.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    ToolDefinition,
)
from tokenmill.api.tool_json import CallDelta
from tokenmill.api.tool_parsers import CallStream, ParsedCall, ToolParser
from tokenmill.api.tool_special import HiddenTokens, hidden_tokens
from tokenmill.api.validation import ServedModel
from tokenmill.chat_template import template_roles, validate_messages
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer

# OpenAI's limits: at most 128 tools, names of letters, digits, "_" and "-", 64 at most.
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# What a template must mention to be handed tools / earlier calls the HF way.
_USES_TOOLS = re.compile(r"\btools\b")
_USES_TOOL_CALLS = re.compile(r"\btool_calls\b")


@dataclass(frozen=True)
class ToolSetup:
    """A request's tools, checked: ``choice`` is "none", "auto", "required" or "named"
    (then ``named`` is the function); ``parallel``: more than one call may be made."""

    tools: list[ToolDefinition]
    choice: str
    named: str | None
    parallel: bool

    @property
    def names(self) -> list[str]:
        """The functions' names, in the order of ``tools``."""
        return [t.function.name for t in self.tools]

    @property
    def schemas(self) -> dict[str, Any]:
        """Each function's parameters schema (None: it takes none), by name."""
        return {t.function.name: t.function.parameters for t in self.tools}

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls (the tools are in the prompt)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether the output must be a call (and is constrained to one)."""
        return self.choice in ("required", "named")


def _check_parameters(schema: dict[str, Any] | None, where: str) -> None:
    """The cheap structural checks of a parameters schema (xgrammar reads it in full when a
    call is forced)."""
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise bad_request(f"{where} must be a JSON schema of an object (type \"object\"), "
                          f"got type {schema.get('type')!r}", "tools")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, (dict, bool)) for p in props.values()):
        raise bad_request(f"{where}.properties must map names to schemas", "tools")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad_request(f"{where}.required must be a list of property names", "tools")


def check_tools(req: ChatCompletionRequest) -> ToolSetup:
    """The request's tool fields, checked; 400 names the field."""
    tools = req.tools or []
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools may hold at most {MAX_TOOLS} functions, got {len(tools)}",
                          "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not _NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                              f"'_' or '-', got {name!r}", "tools")
        if name in seen:
            raise bad_request(f"tools[{i}].function.name {name!r} is defined twice", "tools")
        seen.add(name)
        _check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")
    choice, named = req.tool_choice or ("auto" if tools else "none"), None
    if not isinstance(choice, str):
        named, choice = choice.function.name, "named"
        if named not in seen:
            raise bad_request(f"tool_choice names the function {named!r}, which is not in "
                              f"tools ({', '.join(sorted(seen)) or 'none given'})",
                              "tool_choice")
    if choice == "required" and not tools:
        raise bad_request("tool_choice \"required\" needs tools", "tool_choice")
    return ToolSetup(tools, choice, named, req.parallel_tool_calls)


def forced_call(setup: ToolSetup, parser: ToolParser,
                prompt: str | None = None) -> StructuredOutputsParams | None:
    """The constraint that makes the output a valid call when ``tool_choice`` forces one:
    one call of the named function, or calls of any of the tools (one unless
    ``parallel_tool_calls``), in the model's format after ``prompt`` (the rendered chat);
    None otherwise. 400 for a schema xgrammar cannot read, or a grammar over the size
    limit."""
    if not setup.forced:
        return None
    chosen = [t for t in setup.tools if setup.named in (None, t.function.name)]
    functions = {t.function.name: t.function.parameters for t in chosen}
    # A named function is called once (as OpenAI and vLLM do): repeating the same call is
    # what a sampled small model would otherwise do until max_tokens.
    parallel = setup.parallel and setup.named is None
    try:
        ebnf = parser.forced_grammar(functions, parallel, prompt)
        return StructuredOutputsParams(grammar=ebnf)
    except ValueError as e:
        raise bad_request(f"tools: {e}", "tools") from None


def check_forced_call(params: SamplingParams, served: ServedModel) -> None:
    """Compile the forced call's grammar (cached: the engine reuses it); 400 on ``tools`` when
    it cannot be used or takes too long to compile."""
    try:
        served.compile_grammar(params)
    except ValueError as e:
        raise bad_request(f"tools: {e}", "tools") from None


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template knows of tools, read from its text."""

    tools: bool  # takes the ``tools`` variable
    tool_calls: bool  # renders an assistant message's ``tool_calls``
    tool_role: bool  # renders ``role: "tool"`` messages

    @classmethod
    def of(cls, template: str | None) -> TemplateTools:
        """What ``template`` (a chat template's source; None: no template) knows."""
        text = template or ""
        return cls(bool(_USES_TOOLS.search(text)), bool(_USES_TOOL_CALLS.search(text)),
                   "tool" in template_roles(text))


def _call_arguments(call: Any, where: str) -> tuple[str, Any]:
    """``(name, arguments as JSON)`` of an earlier call an assistant message carries."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": "
                         "{\"name\", \"arguments\"}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = loads_json(args)
        except ValueError:
            raise ValueError(f"{where}.function.arguments must be JSON text") from None
    return fn["name"], args


def _assistant(msg: dict[str, Any], i: int, known: TemplateTools,
               parser: ToolParser) -> dict[str, Any]:
    calls = msg.get("tool_calls")
    if calls is None:
        return msg
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    pairs = [_call_arguments(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
    if known.tool_calls:  # HF templates expect the arguments as an object, not its text
        calls = [{**c, "function": {**c["function"], "arguments": args}}
                 for c, (_, args) in zip(calls, pairs, strict=True)]
        return {**msg, "tool_calls": calls}
    try:
        written = parser.format_calls(pairs) if pairs else ""
    except ValueError as e:  # a name the format cannot write
        raise ValueError(f"messages[{i}].tool_calls: {e}") from None
    content = "\n".join(part for part in (msg.get("content") or "", written) if part)
    return {k: v for k, v in msg.items() if k != "tool_calls"} | {"content": content}


def render_history(messages: list[dict[str, Any]], known: TemplateTools,
                   parser: ToolParser) -> list[dict[str, Any]]:
    """The messages the template is given: earlier calls and their results written in the
    parser's format where the template does not know them (the results that follow one
    assistant turn merged into one user message). ValueError naming the message for a
    malformed call or result."""
    out: list[dict[str, Any]] = []
    results_at: int | None = None  # the user message that collects tool results, if open
    called: dict[str, str] = {}  # the earlier calls' names by id (a result may name it)
    for i, msg in enumerate(validate_messages(messages)):
        role = msg["role"]
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise ValueError(f"messages[{i}] of role tool needs a tool_call_id (a string)")
        if role == "assistant" and isinstance(msg.get("tool_calls"), list):
            called |= {c["id"]: c["function"]["name"] for c in msg["tool_calls"]
                       if isinstance(c, dict) and isinstance(c.get("id"), str)
                       and isinstance(c.get("function"), dict)
                       and isinstance(c["function"].get("name"), str)}
        if role == "tool" and not known.tool_role:
            try:
                result = parser.format_result(msg["content"], called.get(msg["tool_call_id"]))
            except ValueError as e:
                raise ValueError(f"messages[{i}]: {e}") from None
            if results_at is None:
                results_at = len(out)
                out.append({"role": "user", "content": result})
            else:
                out[results_at]["content"] += "\n" + result
            continue
        results_at = None
        out.append(_assistant(msg, i, known, parser) if role == "assistant" else msg)
    return out


def tool_prompt(setup: ToolSetup, parser: ToolParser, messages: list[dict[str, Any]],
                template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the extra template variables that put the request's tools in the
    prompt; raises ValueError (a 400 on ``messages``) for a malformed history."""
    known = TemplateTools.of(template)
    messages = render_history(messages, known, parser)
    if not setup.parses:
        return messages, {}
    if known.tools:
        return messages, {"tools": [t.model_dump(exclude_none=True) for t in setup.tools]}
    functions = [t.function.model_dump(exclude_none=True, exclude={"strict"})
                 for t in setup.tools]
    must = setup.named if setup.choice == "named" else "" if setup.forced else None
    block = parser.system_prompt(functions, must)
    if messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{block}"}, *messages[1:]], {}
    return [{"role": "system", "content": block}, *messages], {}


def tool_calls(calls: list[ParsedCall], parser: ToolParser | None = None) -> list[ToolCall]:
    """OpenAI's ``tool_calls``, each with a new id (in ``parser``'s format's shape)."""
    make_id = parser.new_call_id if parser is not None else new_call_id
    return [ToolCall(id=make_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


def new_call_id() -> str:
    """An id in OpenAI's shape, ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolReader:
    """Reads a request's outputs for calls: whole (``message``) or streamed (``delta``, one
    CallStream per output sequence, arguments in pieces as they are generated)."""

    parser: ToolParser
    names: frozenset[str]
    streams: dict[int, CallStream] = field(default_factory=dict)
    # True: ``delta`` gives each call whole once its block has ended (Ollama's stream and the
    # Responses API's items want whole calls); False: its arguments in pieces, as vLLM does.
    whole_calls: bool = False
    # Per sequence, the calls read but not yet given whole: index -> [name, pieces].
    _pending: dict[int, dict[int, list[str]]] = field(default_factory=dict)
    # The functions' parameters schemas, by name (formats that type values read them).
    schemas: Mapping[str, Any] | None = None
    # Special tokens' text to take out of the content (see keep_special_tokens), and per
    # sequence the end of the content held back because it may begin one.
    hidden: HiddenTokens | None = None
    _held: dict[int, str] = field(default_factory=dict)

    def message(self, text: str,
                finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """The assistant message of a whole output, and its finish reason ("tool_calls" when
        it made calls and stopped by itself)."""
        content, calls = self.parser.parse(text, self.names, self.schemas)
        if content and self.hidden is not None:
            content = self.hidden.visible(content)
        if calls and not content:
            content = None
        message = ChatMessage(content=content, tool_calls=tool_calls(calls, self.parser) or None)
        return message, _finish_reason(bool(calls), finish_reason)

    def delta(self, index: int, text: str, finished: bool,
              finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """The delta of sequence ``index``'s next piece of text (None when everything is
        held back), and its finish reason."""
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = self.parser.stream(self.names, self.schemas)
        events = stream.feed(text)
        if finished:
            events.extend(stream.finish())
        if self.whole_calls:
            deltas = self._whole(index, events.deltas, stream.ended_calls)
        else:
            deltas = [_delta_tool_call(d, self.parser) for d in events.deltas]
        content = events.content
        if self.hidden is not None:
            content = self._held.pop(index, "") + content
            if not finished:
                content, self._held[index] = self.hidden.split_tail(content)
            content = self.hidden.visible(content)
        delta = DeltaMessage(content=content or None, tool_calls=deltas or None) \
            if content or deltas else None
        return delta, _finish_reason(stream.num_calls > 0, finish_reason)


    def _whole(self, index: int, deltas: list[CallDelta], ended: int) -> list[DeltaToolCall]:
        """The calls of sequence ``index`` that ``deltas`` completed, each in one delta."""
        pending = self._pending.setdefault(index, {})
        for d in deltas:
            pending.setdefault(d.index, []).append(d.name if d.name is not None
                                                   else d.arguments)
        out = []
        for i in sorted(i for i in pending if i < ended):
            name, *pieces = pending.pop(i)
            out.append(DeltaToolCall(index=i, id=self.parser.new_call_id(), type="function",
                                     function=DeltaFunctionCall(name=name,
                                                                arguments="".join(pieces))))
        return out


def keep_special_tokens(reader: ToolReader | None, params: SamplingParams,
                        tokenizer: Tokenizer) -> SamplingParams:
    """For a format whose markup is special tokens (Mistral's ``[TOOL_CALLS]`` and
    ``[ARGS]``): the output's text keeps special tokens so that the calls can be read, and
    the reader takes them out of the content (api/tool_special.py). A request that turned
    ``skip_special_tokens`` off sees them as it asked."""
    if reader is None or not reader.parser.keeps_special_tokens or \
            not params.skip_special_tokens:
        return params
    reader.hidden = hidden_tokens(tokenizer)
    return replace(params, skip_special_tokens=False)


def _delta_tool_call(d: CallDelta, parser: ToolParser) -> DeltaToolCall:
    """vLLM's shape: a call's first delta has its id, type and name (arguments ""), the next
    ones only its index and a piece of its arguments."""
    if d.name is None:
        return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
    return DeltaToolCall(index=d.index, id=parser.new_call_id(), type="function",
                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))


def _finish_reason(called: bool, reason: str | None) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason
