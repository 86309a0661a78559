"""POST /v1/embeddings as OpenAI defines it: the request, its validation into engine prompts
and PoolingParams, and the response (floats, or base64 of little-endian float32 as the
``openai`` client decodes it). vLLM's ``truncate_prompt_tokens`` cuts long inputs instead of
refusing them. Every refusal is a 400 naming the field. No input text of more than
MAX_CHARS_PER_TOKEN characters a token of the model's context is ever tokenized: longer ones
are refused, or with truncation only their start is read (tokenizing megabytes would hold the
GIL, and so stall the whole server, for seconds)."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel

from tokenmill.api.chat import MAX_CHARS_PER_TOKEN
from tokenmill.api.errors import bad_request
from tokenmill.api.protocol import StrictModel
from tokenmill.api.validation import ModelFacts
from tokenmill.engine.llm_engine import PromptType
from tokenmill.engine.pooling import embedding_prompt
from tokenmill.outputs import EmbeddingRequestOutput
from tokenmill.request import first_invalid_token_id
from tokenmill.sampling_params import PoolingParams

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(StrictModel):
    """The body of POST /v1/embeddings. ``input`` is checked by hand, for messages that name
    the offending entry."""

    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class EmbeddingModel(ModelFacts, Protocol):
    """What validating an embeddings request needs of the engine (LLMEngine or AsyncLLM)."""

    @property
    def embedding_size(self) -> int: ...

    @property
    def task(self) -> str: ...

    @property
    def cross_encoder(self) -> bool: ...


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def split_inputs(raw: Any) -> list[str | list[int]]:
    """``input`` as a list of texts or of token-id lists; 400 naming the bad entry."""
    if isinstance(raw, str):
        raw = [raw]
    elif _is_token_ids(raw):
        raw = [raw]
    if not isinstance(raw, list):
        raise bad_request("input must be a string, a list of strings, a list of token ids or "
                          f"a list of token-id lists, got {type(raw).__name__}", "input")
    if not raw:
        raise bad_request("input must not be empty", "input")
    if len(raw) > MAX_INPUTS:
        raise bad_request(f"input may hold at most {MAX_INPUTS} entries, got {len(raw)}",
                          "input")
    kind = str if isinstance(raw[0], str) else list
    for i, item in enumerate(raw):
        if kind is str and not isinstance(item, str):
            raise bad_request(f"input[{i}] must be a string like input[0]", "input")
        if kind is list and not _is_token_ids(item):
            raise bad_request(f"input[{i}] must be a non-empty list of token ids (integers)",
                              "input")
        if item == "":
            raise bad_request(f"input[{i}] must not be an empty string", "input")
    return raw


class PoolingCall(Protocol):
    """A prepared embeddings, score or rerank request (this module, api/scores.py): the
    engine prompts to pool, their parameters, and how to answer from the pooled outputs.
    The server and batch jobs run all three the same way."""

    prompts: list[PromptType]
    params: PoolingParams
    id_prefix: str

    def response(self, outputs: Sequence[EmbeddingRequestOutput], model: str) -> BaseModel: ...


@dataclass
class EmbeddingCall:
    """A validated embeddings request: engine prompts (token ids), their parameters, and
    how to answer."""

    prompts: list[PromptType]
    params: PoolingParams
    encoding_format: str
    id_prefix: str = "embd"

    def response(self, outputs: Sequence[EmbeddingRequestOutput], model: str) -> EmbeddingResponse:
        """The response body, ``data`` in the order of the inputs."""
        data = [EmbeddingData(index=i, embedding=encode_embedding(o.embedding,
                                                                   self.encoding_format))
                for i, o in enumerate(outputs)]
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return EmbeddingResponse(data=data, model=model,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as JSON floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _pooling_params(req: EmbeddingRequest, served: EmbeddingModel) -> PoolingParams:
    dims = req.dimensions
    if dims is not None and not 1 <= dims <= served.embedding_size:
        raise bad_request(f"dimensions must be between 1 and this model's embedding size "
                          f"{served.embedding_size}, got {dims}", "dimensions")
    params = truncation_params(req.truncate_prompt_tokens, served)
    return PoolingParams(dimensions=dims, truncate_prompt_tokens=params.truncate_prompt_tokens)


def require_embedding_model(served: EmbeddingModel) -> None:
    """400 unless ``served`` computes embeddings."""
    if served.task != "embed":
        raise bad_request("this model generates text and does not serve embeddings (start an "
                          "engine with --task embed for that)", "model")


def embedding_prompts(inputs: Sequence[str | list[int]], params: PoolingParams,
                      served: EmbeddingModel, param: str = "input",
                      names: Sequence[str] | None = None) -> list[PromptType]:
    """The engine prompts of ``inputs`` (texts or token-id lists), truncated as ``params``
    ask; a 400 naming ``param`` and the entry (``names[i]``, or ``param[i]``) for one the
    model cannot take."""
    tok = served.tokenizer

    def encode(prompt: object) -> tuple[str | None, list[int]]:
        return (prompt, tok.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))

    prompts: list[PromptType] = []
    for i, item in enumerate(inputs):
        where = (names[i] if names is not None else param if len(inputs) == 1
                 else f"{param}[{i}]")
        if isinstance(item, list):
            bad = first_invalid_token_id(item, served.vocab_size)
            if bad is not None:
                raise bad_request(f"{where}: token id {item[bad]!r} at index {bad} is not in "
                                  f"[0, {served.vocab_size})", param)
        item = bounded_text(item, where, param, params, served.max_model_len)
        try:
            text, ids = embedding_prompt(encode, tok, item, params, served.max_model_len)
        except ValueError as e:
            raise bad_request(f"{where}: {e}", param) from None
        prompts.append({"prompt": text, "prompt_token_ids": ids} if text is not None
                       else {"prompt_token_ids": ids})
    return prompts


def bounded_text(item: str | list[int], where: str, param: str, params: PoolingParams,
                  max_model_len: int) -> str | list[int]:
    """A text input of at most ``max_model_len * MAX_CHARS_PER_TOKEN`` characters: a longer
    one is a 400 naming the field and the limit, or, truncated anyway, cut to that many
    (the tokens kept lie there unless they average more than MAX_CHARS_PER_TOKEN
    characters)."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if not isinstance(item, str) or len(item) <= limit:
        return item
    if params.truncate_prompt_tokens is not None:
        return item[:limit]
    raise bad_request(f"{where} has {len(item)} characters, more than the {limit} this "
                      "model's context can take (set truncate_prompt_tokens to read only "
                      "its start)", param)


def truncation_params(k: int | None, served: EmbeddingModel) -> PoolingParams:
    """PoolingParams cutting inputs to ``k`` tokens (vLLM's ``truncate_prompt_tokens``);
    400 for a length the model cannot take."""
    if k is not None and not (k == -1 or 1 <= k <= served.max_model_len):
        raise bad_request(f"truncate_prompt_tokens must be -1 or between 1 and "
                          f"{served.max_model_len}, got {k}", "truncate_prompt_tokens")
    return PoolingParams(truncate_prompt_tokens=k)


def prepare_embeddings(req: EmbeddingRequest, served: EmbeddingModel) -> EmbeddingCall:
    """Validate and tokenize (CPU work: run it off the event loop); 400 names the field."""
    require_embedding_model(served)
    if served.cross_encoder:
        raise bad_request("this model is a cross-encoder: it scores pairs of texts (POST "
                          "/v1/score, /v1/rerank) and computes no embeddings", "model")
    params = _pooling_params(req, served)
    prompts = embedding_prompts(split_inputs(req.input), params, served)
    return EmbeddingCall(prompts, params, req.encoding_format)
