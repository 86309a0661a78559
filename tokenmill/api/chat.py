"""Chat completions: the chat template rendered into a prompt, the request validated into
SamplingParams, and the answer built whole or as streamed chunks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import jinja2

from tokenmill.api.errors import bad_request
from tokenmill.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionTokensDetails,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from tokenmill.api.reasoning import ReasoningReader, ReasoningSetup, resolve_reasoning_parser
from tokenmill.api.reasoning_request import (
    apply_reasoning,
    check_effort,
    check_template_switch,
    requested_budget,
)
from tokenmill.api.response_building import Collected, TokenTexts, finite
from tokenmill.api.tool_parsers import ToolParser, resolve_parser
from tokenmill.api.tools import (
    ToolReader,
    ToolSetup,
    check_forced_call,
    check_tools,
    forced_call,
    keep_special_tokens,
    tool_prompt,
)
from tokenmill.api.validation import (
    ServedModel,
    beam_max_tokens,
    check_context,
    check_grammar,
    sampling_params,
)
from tokenmill.engine.llm_engine import PromptType
from tokenmill.outputs import RequestOutput, TokenLogprobs
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams
from tokenmill.tokenizer import Tokenizer

# More messages than any context holds; keeps template rendering bounded.
MAX_CHAT_MESSAGES = 4096
# A rendered prompt longer than max_model_len tokens of this many characters each cannot fit:
# refused before it is tokenized. (Tokens of real text average 3-5 characters.)
MAX_CHARS_PER_TOKEN = 32


# The request's checked tools and the format calls are written in.
ToolPrompt = tuple[ToolSetup, ToolParser]

# What rendering a chat template can raise on the data it is given (the template is the
# model's; what it is fed is the client's): a 400, never a 500.
TEMPLATE_ERRORS = (ValueError, TypeError, LookupError, ArithmeticError, jinja2.TemplateError)


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], /,
                max_chars: int | None = None, markup: Callable[[str], str] | None = None,
                **template_kwargs: Any) -> tuple[str, list[int]]:
    """The chat template applied to ``messages`` (ready for the assistant's turn), and its
    token ids, special-token text inside the messages read as plain text (the template holds
    any BOS the model wants; ``markup``: the server's own, see Tokenizer.encode_chat);
    whatever the template raises goes to the caller."""
    if len(messages) > MAX_CHAT_MESSAGES:
        raise ValueError(f"a conversation may hold at most {MAX_CHAT_MESSAGES} messages, "
                         f"got {len(messages)}")
    return tokenizer.encode_chat(messages, add_generation_prompt=True, max_chars=max_chars,
                                 markup=markup, **template_kwargs)


def render_prompt(tokenizer: Tokenizer, req: ChatCompletionRequest, max_model_len: int,
                  tools: ToolPrompt | None = None) -> tuple[str, list[int]]:
    """The chat template applied to the messages (with the request's tools, see api/tools.py),
    and its token ids; 400 if it cannot be, or if the rendered text is too long for the
    context (checked before tokenizing it)."""
    try:
        messages, extra, markup = req.messages, {}, None
        if tools is not None:
            messages, extra = tool_prompt(*tools, req.messages, tokenizer.chat_template)
            markup = tools[1].expand_history  # earlier calls in markup the template lacks
        effort = {"reasoning_effort": req.reasoning_effort} \
            if req.reasoning_effort is not None else {}
        return chat_prompt(tokenizer, messages, max_model_len * MAX_CHARS_PER_TOKEN, markup,
                           **{**effort, **(req.chat_template_kwargs or {}), **extra})
    except TEMPLATE_ERRORS as e:
        raise bad_request(f"messages: {e}", "messages") from None


def chat_logprobs(lps: list[TokenLogprobs], k: int, texts: TokenTexts) -> ChatLogprobs:
    """OpenAI's chat ``logprobs.content`` for the given tokens, with ``k`` alternatives each."""
    content = []
    for lp in lps:
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:k]
        token = texts(lp.token_id)
        content.append(ChatTokenLogprob(
            token=token, logprob=finite(lp.logprob), bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=texts(t), logprob=finite(v),
                                     bytes=list(texts(t).encode())) for t, v in top]))
    return ChatLogprobs(content=content)


def logprobs_k(req: ChatCompletionRequest) -> int | None:
    """Alternatives per token that the response's logprobs carry; None without logprobs."""
    return (req.top_logprobs or 0) if req.logprobs else None


@dataclass
class ChatCall:
    """A validated chat request: its one engine prompt and its sampling parameters."""

    id_prefix: ClassVar[str] = "chatcmpl"
    req: ChatCompletionRequest
    engine_prompts: list[PromptType]
    params: SamplingParams
    tokenizer: Tokenizer
    # Reads the outputs for tool calls (None: plain text).
    tools: ToolReader | None = None
    # Reads the outputs for a reasoning model's thinking (None: all of it is the answer).
    reasoning: ReasoningReader | None = None

    def response(self, result: Collected, model: str, rid: str,
                 created: int) -> ChatCompletionResponse:
        """The whole (non-streamed) response body of the finished request."""
        texts = TokenTexts(self.tokenizer)
        k = logprobs_k(self.req)
        choices = []
        for i, c in enumerate(result.choices[0]):
            text, thinking = "".join(c.text), None
            if self.reasoning is not None:
                thinking, text = self.reasoning.split(text)
            message, reason = ChatMessage(content=text), c.finish_reason
            if self.tools is not None:
                message, reason = self.tools.message(text, reason)
            if thinking is not None:
                message.content = message.content or None
                message.reasoning_content = message.reasoning = thinking
            choices.append(ChatChoice(
                index=i, message=message,
                logprobs=chat_logprobs(c.logprobs, k, texts) if k is not None else None,
                finish_reason=reason, stop_reason=c.stop_reason))
        usage = result.usage()
        if self.reasoning is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(
                self.reasoning.count(c.token_ids) for c in result.choices[0]))
        return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                      usage=usage)

    def chunks(self, model: str, rid: str, created: int) -> ChatChunks:
        """The builder of this request's streamed chunks (see StreamChunks)."""
        return ChatChunks(self, model, rid, created)


@dataclass
class ChatChunks:
    """Streamed chunks: the role first, then content deltas and the finish reasons."""

    call: ChatCall
    model: str
    rid: str
    created: int
    # A finished sequence keeps its finish_reason in later deltas: send nothing more for it.
    done: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.call.tokenizer)
        self.k = logprobs_k(self.call.req)

    def _chunk(self, choices: list[ChatChunkChoice],
               usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model,
                                   choices=choices, usage=usage)

    def opening(self) -> list[ChatCompletionChunk]:
        return [self._chunk([ChatChunkChoice(index=i,
                                             delta=DeltaMessage(role="assistant", content=""))
                             for i in range(self.call.req.n)])]

    def delta(self, index: int, out: RequestOutput) -> ChatCompletionChunk | None:
        choices = []
        for c in out.outputs:
            if c.index in self.done or (not c.text and not c.token_ids and not c.finished):
                continue
            if c.finished:
                self.done.add(c.index)
            lps = chat_logprobs(c.logprobs or [], self.k, self.texts) \
                if self.k is not None else None
            text, thinking = c.text, ""
            if self.call.reasoning is not None:
                self.call.reasoning.observe(c.index, c.token_ids)
                thinking, text = self.call.reasoning.delta(c.index, c.text, c.finished)
            delta, reason = DeltaMessage(content=text), c.finish_reason
            if self.call.tools is not None:
                delta, reason = self.call.tools.delta(c.index, text, c.finished, reason)
            elif self.call.reasoning is not None and not text:
                delta = None
            if thinking:
                delta = delta or DeltaMessage()
                delta.reasoning_content = delta.reasoning = thinking
            if delta is None and lps is None and not c.finished:
                continue  # held back: the text may be markup (a call's, the thinking's)
            choices.append(ChatChunkChoice(
                index=c.index, delta=delta or DeltaMessage(), logprobs=lps,
                finish_reason=reason, stop_reason=c.stop_reason))
        return self._chunk(choices) if choices else None

    def usage(self, usage: UsageInfo) -> ChatCompletionChunk:
        if self.call.reasoning is not None:
            usage.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=self.call.reasoning.streamed_count)
        return self._chunk([], usage)


def prepare_chat(req: ChatCompletionRequest, served: ServedModel,
                 tool_call_parser: str = "auto",
                 reasoning: ReasoningSetup | None = None) -> ChatCall:
    """The engine prompt and sampling parameters of a chat request; 400 names the bad field.
    ``tool_call_parser``: the tool-call format (see api/tool_parsers.py); ``reasoning``: the
    reasoning parser and default thinking budget (see api/reasoning.py).

    Shared by the server and the batch job, so both accept and reject the same bodies."""
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                          "top_logprobs")
    tokenizer = served.tokenizer
    setup = check_tools(req)
    parser = resolve_parser(tool_call_parser, tokenizer.chat_template)
    reasoning = reasoning or ReasoningSetup()
    thinker = resolve_reasoning_parser(reasoning.parser, tokenizer.chat_template)
    parser = parser.with_reasoning(thinker.name if thinker is not None else None)
    check_template_switch(req.chat_template_kwargs, thinker, tokenizer.chat_template)
    check_effort(req.reasoning_effort, thinker, tokenizer.chat_template)
    budget = requested_budget({"thinking_token_budget": req.thinking_token_budget,
                               "max_thinking_tokens": req.max_thinking_tokens})
    text, ids = render_prompt(tokenizer, req, served.max_model_len, (setup, parser))
    forced = forced_call(setup, parser, text)  # harmony's call opens where the prompt ends
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_context(len(ids), max_tokens, served.max_model_len, "messages", param)
    max_tokens = beam_max_tokens(req, max_tokens, [len(ids)], served.max_model_len)
    params = sampling_params(req, served.vocab_size, max_tokens=max_tokens,
                             logprobs=logprobs_k(req))
    if forced is not None and params.use_beam_search:
        raise bad_request("a tool_choice that forces a call cannot be used with "
                          "use_beam_search: the call is forced by a grammar, and beams are "
                          "ranked by the model's own logprobs", "tool_choice")
    if forced is not None:
        if params.structured_outputs is not None:
            raise bad_request("a tool_choice that forces a call cannot be combined with "
                              "another output constraint", "tool_choice")
        params = replace(params, structured_outputs=forced)
        check_forced_call(params, served)
    else:
        check_grammar(req, params, served)
    thinking, params = apply_reasoning(thinker, budget, reasoning.max_thinking_tokens, text,
                                       tokenizer, params)
    reader = ToolReader(parser, frozenset(setup.names), schemas=setup.schemas) \
        if setup.parses else None
    params = keep_special_tokens(reader, params, tokenizer)  # Mistral's [TOOL_CALLS] / [ARGS]
    return ChatCall(req, [{"prompt": text, "prompt_token_ids": ids}], params, tokenizer, reader,
                    thinking)
