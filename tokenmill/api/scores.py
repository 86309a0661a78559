"""POST /v1/score and POST /v1/rerank, with vLLM's request and response shapes (its /rerank is
also Jina's and, for the fields they share, Cohere's). On an embedding model the texts are
embedded once each and every pair is scored by the cosine similarity of its two embeddings
(tokenmill/engine/scoring.py); on a cross-encoder (reranker) each pair is one input, the two
texts read together, and its head's output is the score. A call is prepared like an
embeddings call (its ``prompts`` and ``params``) and answered from the same outputs, so the
server and batch jobs run it exactly as they run /v1/embeddings. Every refusal is a 400
naming the field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel

from tokenmill.api.embeddings import (
    MAX_INPUTS,
    EmbeddingModel,
    EmbeddingUsage,
    bounded_text,
    embedding_prompts,
    require_embedding_model,
    truncation_params,
)
from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.protocol import StrictModel, now, random_id
from tokenmill.engine.llm_engine import PromptType
from tokenmill.engine.scoring import Pairs, cross_encoder_prompts, pair_texts, scores_of
from tokenmill.outputs import EmbeddingRequestOutput
from tokenmill.sampling_params import PoolingParams


class ScoreRequest(StrictModel):
    """The body of POST /v1/score: ``text_1`` (one text, or as many as ``text_2``) scored
    against each text of ``text_2``. The texts are checked by hand, for messages that name
    the offending entry."""

    model: str | None = None
    text_1: Any
    text_2: Any
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(StrictModel):
    """The body of POST /v1/rerank: ``documents`` ordered by their score against ``query``,
    the best ``top_n`` of them (None or 0: all)."""

    model: str | None = None
    query: Any
    documents: Any
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _tokens(outputs: Sequence[EmbeddingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outputs)


def _scores(pairs: Pairs, pairwise: bool,
            outputs: Sequence[EmbeddingRequestOutput]) -> list[float]:
    return scores_of(pairs, pairwise, [o.embedding for o in outputs])


@dataclass
class ScoreCall:
    """A validated score request: the engine prompts of its distinct texts, their
    parameters, and how to answer from their embeddings."""

    prompts: list[PromptType]
    params: PoolingParams
    pairs: Pairs
    pairwise: bool
    id_prefix: str = "score"

    def response(self, outputs: Sequence[EmbeddingRequestOutput], model: str) -> ScoreResponse:
        """The response body, ``data`` in the order of ``text_2``."""
        scores = _scores(self.pairs, self.pairwise, outputs)
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        tokens = _tokens(outputs)
        return ScoreResponse(id=random_id(self.id_prefix), created=now(), model=model,
                             data=data, usage=EmbeddingUsage(prompt_tokens=tokens,
                                                             total_tokens=tokens))


@dataclass
class RerankCall:
    """A validated rerank request: the query's and documents' engine prompts, their
    parameters, and how to answer from their embeddings."""

    prompts: list[PromptType]
    params: PoolingParams
    pairs: Pairs
    pairwise: bool
    documents: list[str]
    top_n: int
    return_documents: bool
    id_prefix: str = "rerank"

    def response(self, outputs: Sequence[EmbeddingRequestOutput], model: str) -> RerankResponse:
        """The response body: the best ``top_n`` documents, highest score first (ties in the
        order given)."""
        scores = _scores(self.pairs, self.pairwise, outputs)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:self.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=self.documents[i])
                                if self.return_documents else None)
                   for i in order]
        tokens = _tokens(outputs)
        return RerankResponse(id=random_id(self.id_prefix), model=model, results=results,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))


def _refusal(e: ValueError, names: tuple[str, str]) -> APIError:
    """A 400 for a pairing's ValueError, its field the name the message starts with
    ("text_2[3] must ...", "documents[1]: the pair has ...")."""
    field = next(n for n in names if str(e).startswith(n))
    return bad_request(str(e), field)


def _pairs(text_1: Any, text_2: Any, names: tuple[str, str]) -> Pairs:
    try:
        return pair_texts(text_1, text_2, MAX_INPUTS, names)
    except ValueError as e:
        raise _refusal(e, names) from None


def _prompts(pairs: Pairs, params: PoolingParams, served: EmbeddingModel,
             names: tuple[str, str]) -> list[PromptType]:
    """An embedding model's: each distinct text's prompt. A cross-encoder's: each pair's, its
    two texts in the tokenizer's pair template."""
    if not served.cross_encoder:
        prompts: list[PromptType] = []
        for text, name in zip(pairs.texts, pairs.names, strict=True):
            prompts += embedding_prompts([text], params, served, name.split("[")[0],
                                         names=[name])
        return prompts
    # Each text is bounded before the pair is tokenized, as an embedding input is: a huge text
    # would hold the tokenizer (and the GIL) for seconds, only to be refused after.
    texts = [bounded_text(text, name, name.split("[")[0], params, served.max_model_len)
             for text, name in zip(pairs.texts, pairs.names, strict=True)]
    try:
        ids = cross_encoder_prompts(replace(pairs, texts=texts), served.tokenizer, params,
                                    served.max_model_len)
    except ValueError as e:
        raise _refusal(e, names) from None
    return [{"prompt_token_ids": p} for p in ids]


def prepare_score(req: ScoreRequest, served: EmbeddingModel) -> ScoreCall:
    """Validate and tokenize (CPU work: run it off the event loop); 400 names the field."""
    require_embedding_model(served)
    params = truncation_params(req.truncate_prompt_tokens, served)
    names = ("text_1", "text_2")
    pairs = _pairs(req.text_1, req.text_2, names)
    return ScoreCall(_prompts(pairs, params, served, names), params, pairs,
                     served.cross_encoder)


def prepare_rerank(req: RerankRequest, served: EmbeddingModel) -> RerankCall:
    """Validate and tokenize (CPU work: run it off the event loop); 400 names the field."""
    require_embedding_model(served)
    params = truncation_params(req.truncate_prompt_tokens, served)
    if not isinstance(req.query, str):
        raise bad_request(f"query must be a string, got {type(req.query).__name__}", "query")
    if req.top_n is not None and req.top_n < 0:
        raise bad_request(f"top_n must be 0 (all) or a positive integer, got {req.top_n}",
                          "top_n")
    if isinstance(req.documents, str):  # one text: a list of one, as the other APIs say
        raise bad_request("documents must be a list of strings, got a string", "documents")
    names = ("query", "documents")
    pairs = _pairs(req.query, req.documents, names)
    documents = list(req.documents)
    top_n = req.top_n or len(documents)
    return RerankCall(_prompts(pairs, params, served, names), params, pairs,
                      served.cross_encoder, documents, top_n, req.return_documents)
