"""Pydantic shapes of OpenAI's Responses API (POST /v1/responses): the request, its tools, the
response object and its output items. The logic lives in api/responses_api.py.

The request is strict like the other endpoints' (see api/protocol.py). ``input``, ``tools`` and
``tool_choice`` are read as plain JSON here and checked item by item in
api/responses_input.py, so that a bad item gets a 400 naming it (``input[2].content``) rather
than a list of every union member it failed to match.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenmill.api.protocol import ChatTokenLogprob, StrictModel
from tokenmill.api.vector_stores import Filter


class TextFormat(StrictModel):
    """``text.format``: plain text, any JSON object, or JSON matching a schema (the Responses
    API spells json_schema flat: ``{"type": "json_schema", "name", "schema", "strict"}``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    """``text``: the format of the output text."""

    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningConfig(StrictModel):
    """``reasoning``: ``effort`` goes to the chat template as chat's ``reasoning_effort``
    (gpt-oss's system message); a summary of the thinking is not written (``summary`` is
    accepted and the reasoning item carries the thinking itself)."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(StrictModel):
    """POST /v1/responses. ``seed`` is tokenmill's extension (OpenAI's API has none)."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    parallel_tool_calls: bool = True
    user: str | None = None
    background: bool = False
    seed: int | None = None
    reasoning: ReasoningConfig | None = None


# ----------------------------------------------------------------------------- tools


class RankingOptions(StrictModel):
    """``ranking_options`` of the file_search tool: results scoring below the threshold are
    left out (``ranker`` is accepted; there is one ranker)."""

    ranker: str | None = None
    score_threshold: float | None = Field(default=None, ge=0.0, le=1.0)


class FileSearchTool(StrictModel):
    """``{"type": "file_search", "vector_store_ids": [...], ...}``: the server searches the
    stores with the user's question before generating (see api/file_search.py)."""

    type: Literal["file_search"]
    vector_store_ids: list[str]
    max_num_results: int = Field(default=10, ge=1, le=50)
    filters: Filter | None = None
    ranking_options: RankingOptions | None = None


class FunctionTool(StrictModel):
    """``{"type": "function", "name", "parameters", "strict"}``: a function the model may
    call; the call comes back as a ``function_call`` output item."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# ----------------------------------------------------------------------------- output


class FileCitation(BaseModel):
    """A file the answer drew from; ``index`` is where in the text the citation belongs."""

    type: Literal["file_citation"] = "file_citation"
    index: int
    file_id: str
    filename: str


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[FileCitation] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    """The assistant's answer as an output item."""

    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FileSearchResult(BaseModel):
    """One retrieved chunk, in a ``file_search_call`` item's ``results``."""

    file_id: str
    filename: str
    score: float
    text: str
    attributes: dict[str, str | float | bool] | None = None


class FileSearchCall(BaseModel):
    """The search the server ran; ``results`` only when ``include`` asks for them."""

    type: Literal["file_search_call"] = "file_search_call"
    id: str
    status: Literal["in_progress", "searching", "completed", "incomplete", "failed"]
    queries: list[str]
    results: list[FileSearchResult] | None = None


class FunctionCallItem(BaseModel):
    """A call the model made; the client answers with a ``function_call_output`` item that
    names the same ``call_id``."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A reasoning model's thinking, before its answer (see api/reasoning.py)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "in_progress"


OutputItem = ReasoningItem | OutputMessage | FileSearchCall | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """OpenAI's usage, and tokenmill's additions that chat's usage has too: the request's
    share of the engine steps that computed it, their energy (J) and cost (USD)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    compute_seconds: float | None = None
    energy_joules: float | None = None
    energy_estimated: bool | None = None
    cost_usd: float | None = None


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseObject(BaseModel):
    """The response object: returned whole, carried by the stream's lifecycle events, and kept
    for ``GET /v1/responses/{id}`` when ``store`` is true."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True


class DeletedResponse(BaseModel):
    """The body of ``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
