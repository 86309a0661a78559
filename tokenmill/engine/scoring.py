"""Scores of text pairs. On an embedding model, as vLLM scores them for one: every text is
embedded once (a query paired with many documents too), and a pair's score is the cosine
similarity of its two embeddings, in [-1, 1]. On a cross-encoder, each pair is one input (the
tokenizer's pair template) and the model's head gives its score. ``LLM.score``, POST
/v1/score and POST /v1/rerank all pair their texts, build a cross-encoder's inputs and read
the scores here.

Pairing follows vLLM's ``score``: one first text against N second texts (1 to N), or N first
texts against N second texts, pair i being the i-th of each (N to N).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.engine.pooling import pair_prompt_ids
from tokenmill.sampling_params import PoolingParams
from tokenmill.tokenizer import Tokenizer


@dataclass(frozen=True)
class Pairs:
    """The distinct texts to embed, where each first stands (``text_2[3]``), and each pair as
    two indices into them."""

    texts: list[str]
    names: list[str]
    pairs: list[tuple[int, int]]


def _as_texts(value: object, name: str) -> list[str]:
    """A string or a non-empty list of strings, as a list; ValueError naming ``name``."""
    single = isinstance(value, str)
    if single:
        value = [value]
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a string or a list of strings, "
                         f"got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")
    for i, text in enumerate(value):
        where = name if single else f"{name}[{i}]"
        if not isinstance(text, str):
            raise ValueError(f"{where} must be a string, got {type(text).__name__}")
        if not text:
            raise ValueError(f"{where} must not be an empty string")
    return list(value)


def pair_texts(text_1: object, text_2: object, max_pairs: int | None = None,
               names: tuple[str, str] = ("text_1", "text_2")) -> Pairs:
    """The pairs ``text_1`` x ``text_2`` name (1 to N or N to N); ValueError naming the
    argument (as ``names`` call them) that is wrong: not text, empty, lengths that do not
    pair, or more than ``max_pairs`` pairs."""
    name_1, name_2 = names
    first, second = _as_texts(text_1, name_1), _as_texts(text_2, name_2)
    if len(first) != 1 and len(first) != len(second):
        raise ValueError(f"{name_1} must hold one text or as many as {name_2} ({len(second)}), "
                         f"got {len(first)}")
    if max_pairs is not None and len(second) > max_pairs:
        raise ValueError(f"{name_2} may hold at most {max_pairs} texts, got {len(second)}")
    index: dict[str, int] = {}
    where: list[str] = []
    for name, texts, single in ((name_1, first, isinstance(text_1, str)),
                                (name_2, second, isinstance(text_2, str))):
        for i, text in enumerate(texts):
            if text not in index:
                index[text] = len(index)
                where.append(name if single else f"{name}[{i}]")
    if len(first) == 1:
        first = first * len(second)
    return Pairs(list(index), where,
                 [(index[a], index[b]) for a, b in zip(first, second, strict=True)])


def pair_scores(pairs: Pairs, embeddings: Sequence[Sequence[float]]) -> list[float]:
    """Each pair's cosine similarity (0.0 where either vector is all zeros), given the
    embeddings of ``pairs.texts`` in order."""
    if len(embeddings) != len(pairs.texts):
        raise ValueError(f"{len(embeddings)} embeddings for {len(pairs.texts)} texts")
    vectors = np.asarray(embeddings, dtype=np.float64)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit = np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0.0)
    first, second = (np.fromiter((p[k] for p in pairs.pairs), dtype=np.int64,
                                 count=len(pairs.pairs)) for k in (0, 1))
    scores = np.einsum("ij,ij->i", unit[first], unit[second])
    return [float(s) for s in np.clip(scores, -1.0, 1.0)]


def cross_encoder_prompts(pairs: Pairs, tokenizer: Tokenizer, params: PoolingParams,
                          max_model_len: int) -> list[list[int]]:
    """A cross-encoder's input token ids for each pair (see ``pair_prompt_ids``); ValueError
    starting with the name of the second text of a pair that is too long (``text_2[3]: ...``)."""
    out = []
    for i, j in pairs.pairs:
        try:
            out.append(pair_prompt_ids(tokenizer, pairs.texts[i], pairs.texts[j], params,
                                       max_model_len))
        except ValueError as e:
            raise ValueError(f"{pairs.names[j]}: {e}") from None
    return out


def scores_of(pairs: Pairs, cross_encoder: bool,
              pooled: Sequence[Sequence[float]]) -> list[float]:
    """Each pair's score from the engine's pooled outputs: a cross-encoder's, one output a
    pair (its single entry); else the cosine of the pair's embeddings, one output a distinct
    text."""
    if cross_encoder:
        return [p[0] for p in pooled]
    return pair_scores(pairs, pooled)
