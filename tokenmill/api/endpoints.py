"""The inference endpoints by URL, and the request of each prepared for the engine."""

from __future__ import annotations

from pydantic import BaseModel

from tokenmill.api.chat import ChatCall, prepare_chat
from tokenmill.api.classify import ClassifyRequest
from tokenmill.api.completions import CompletionCall, prepare_completion
from tokenmill.api.embeddings import EmbeddingRequest
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.api.reasoning import ReasoningSetup
from tokenmill.api.scores import RerankRequest, ScoreRequest
from tokenmill.api.validation import ServedModel

# The endpoints that run the model, and the schema of their bodies (/v1/classify is
# prepared by api/classify.py: it scores labels rather than generating; /v1/embeddings by
# api/embeddings.py, /v1/score and /v1/rerank by api/scores.py).
ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/classify": ClassifyRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
}


def prepare(req: ChatCompletionRequest | CompletionRequest, served: ServedModel, *,
            split_special_tokens: bool = False,
            tool_call_parser: str = "auto",
            reasoning: ReasoningSetup | None = None) -> ChatCall | CompletionCall:
    """The engine prompts and sampling parameters of a request; 400 names the bad field.
    ``split_special_tokens``: completions' text prompts read special-token text as plain text
    (chat messages always do). ``tool_call_parser``: the format of chat's tool calls;
    ``reasoning``: chat's reasoning parser and default thinking budget."""
    if isinstance(req, ChatCompletionRequest):
        return prepare_chat(req, served, tool_call_parser, reasoning)
    return prepare_completion(req, served, split_special_tokens=split_special_tokens)
