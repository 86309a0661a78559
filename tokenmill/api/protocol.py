"""Pydantic schemas of the OpenAI-compatible API: requests (validated strictly) and responses.

Requests use strict mode: a number sent as a string, a float where an integer belongs or a
boolean where a number belongs is a 400, not silently converted. Unknown fields are ignored,
as the OpenAI API does for fields it does not know.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)


def random_id(prefix: str) -> str:
    """An OpenAI-shaped id such as ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix seconds, for ``created``."""
    return int(time.time())


class StrictModel(BaseModel):
    """The base of every request schema of the API: strict types, no NaN or infinity,
    unknown fields ignored (see the module's docstring)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False


class JSONSchemaFormat(StrictModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str = "response"
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(StrictModel):
    """vLLM's ``structured_outputs``: exactly one of the constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # tokenmill: let the JSON have any whitespace between tokens (default compact).
    any_whitespace: bool = False


class SamplingFields(StrictModel):
    """Fields shared by chat and completions; the last group is tokenmill's (and vLLM's)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # False opts this request out of the server's speculative decoding.
    speculative: bool = True
    # vLLM's scheduling priority: lower runs first (a project key may not go below its
    # project's priority class).
    priority: int = 0
    # Beam search (vLLM's fields): ``n`` (completions: ``best_of`` when given) is the beam
    # width, and the choices are the best hypotheses, best first (see SamplingParams).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # Structured outputs: OpenAI's field, vLLM's, and vLLM's older spellings.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a chunk that carries the usage."""
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    """One entry of ``tools``: a function the model may call."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (see api/tools.py).
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Reasoning models (see api/reasoning.py): a hard limit on the thinking tokens, under
    # vLLM's name and llama.cpp's; at most one of them.
    thinking_token_budget: int | None = None
    max_thinking_tokens: int | None = None
    # OpenAI's: how hard a reasoning model thinks; given to the chat template as
    # ``reasoning_effort`` (gpt-oss's template writes it into its system message).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: ``prompt`` is a string, strings, token ids or lists of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(StrictModel):
    """POST /tokenize: either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- responses


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # OpenAI's: how many prompt tokens came from the prefix cache.
    prompt_tokens_details: PromptTokensDetails | None = None
    # OpenAI's: how many completion tokens were thinking (set when a reasoning parser reads
    # the output).
    completion_tokens_details: CompletionTokensDetails | None = None
    # tokenmill's additions: the request's share of the engine steps that computed it, their
    # energy (J; energy_estimated when not read from a counter) and cost (USD).
    compute_seconds: float | None = None
    energy_joules: float | None = None
    energy_estimated: bool | None = None
    cost_usd: float | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _reasoning_field() -> Any:
    """A message's thinking: left out of the JSON when None, so that a model that does not
    think answers exactly as before."""
    return Field(default=None, exclude_if=lambda v: v is None)


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    # The model's thinking (vLLM's field, and its newer name).
    reasoning_content: str | None = _reasoning_field()
    reasoning: str | None = _reasoning_field()


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class _OmitsNone(BaseModel):
    """Written without its None fields: a tool call's later deltas carry only what they add
    (as vLLM's do; a client that appends each delta's name would append "null")."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitsNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitsNone):
    """A streamed piece of a tool call; ``index`` says which call it continues."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = _reasoning_field()
    reasoning: str | None = _reasoning_field()


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Both the whole response and each streamed chunk (``object`` is the same for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    max_model_len: int
    # A LoRA adapter's base model and folder (vLLM's fields); None for a model.
    parent: str | None = None
    root: str | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body); unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = Field(default=None, min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM also takes ``lora_int_id``: the name is enough)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
