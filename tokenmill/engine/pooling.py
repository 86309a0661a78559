"""Embedding requests in the LLMEngine: their prompts (with truncation), the ones in flight,
and their outputs.

An embedding request runs through the scheduler like any other; it differs only in what
comes back: once the step that computed its prompt has run, the core reports the pooled
vector and the request is done. Its output skips the detokenizer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.core.sched_output import EngineCoreOutput
from tokenmill.outputs import EmbeddingRequestOutput, RequestMetrics
from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.tokenizer import Tokenizer

# What the scheduler's request shape needs of an embedding request's sampling parameters:
# nothing is sampled.
EMBEDDING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)

Encoder = Callable[[object], tuple[str | None, list[int]]]


def truncation_limit(params: PoolingParams, max_model_len: int) -> int | None:
    """The token count ``truncate_prompt_tokens`` cuts inputs to (None: no cutting)."""
    k = params.truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens {k} is more than this model's maximum input "
                         f"length of {max_model_len} tokens")
    return k


def truncated_text_ids(tokenizer: Tokenizer, text: str, limit: int) -> list[int]:
    """``text``'s token ids cut to ``limit`` tokens, its own tokens cut at the end and the
    tokenizer's special tokens around it kept (as the tokenizer's own truncation does)."""
    backend = tokenizer.backend
    encoding = backend.encode(text, add_special_tokens=False)
    room = limit - backend.num_special_tokens_to_add(False)
    if room < 1:
        raise ValueError(f"truncate_prompt_tokens {limit} leaves no room for the text besides "
                         "the special tokens the tokenizer adds")
    if len(encoding.ids) > room:
        encoding.truncate(room)
    return backend.post_process(encoding).ids


def _longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """How many tokens of each text a pair keeps in ``room``: the tokenizers library's
    "longest_first" truncation (what transformers' ``truncation=True`` does to a pair)."""
    if n1 + n2 <= room:
        return n1, n2
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > room else max(n1, room - n1)
    if n1 + n2 > room:
        n1 = room // 2
        n2 = n1 + room % 2
    return (n2, n1) if swap else (n1, n2)


def pair_prompt_ids(tokenizer: Tokenizer, first: str, second: str,
                    params: PoolingParams, max_model_len: int) -> list[int]:
    """A cross-encoder's input for a pair of texts, as the tokenizer's pair template writes
    it (BERT: ``[CLS] first [SEP] second [SEP]``), cut as ``params`` ask: the longer text
    loses tokens first, as transformers cuts a pair. ValueError for a pair longer than
    ``max_model_len`` without truncation."""
    backend = tokenizer.backend
    a = backend.encode(first, add_special_tokens=False)
    b = backend.encode(second, add_special_tokens=False)
    limit = truncation_limit(params, max_model_len)
    if limit is not None:
        room = limit - backend.num_special_tokens_to_add(True)
        if room < 2:
            raise ValueError(f"truncate_prompt_tokens {limit} leaves no room for the two texts "
                             "besides the special tokens the tokenizer adds")
        n1, n2 = _longest_first(len(a.ids), len(b.ids), room)
        a.truncate(n1)
        b.truncate(n2)
    ids = backend.post_process(a, b).ids
    if len(ids) > max_model_len:
        raise ValueError(f"the pair has {len(ids)} tokens, more than this model's maximum of "
                         f"{max_model_len}; shorten it or set truncate_prompt_tokens")
    return ids


def embedding_prompt(encode: Encoder, tokenizer: Tokenizer, prompt: object,
                     params: PoolingParams, max_model_len: int) -> tuple[str | None, list[int]]:
    """The text and token ids an embedding is computed from, truncated as ``params`` ask;
    ValueError for an empty input or one longer than ``max_model_len`` without truncation.
    ``encode`` is the engine's validating prompt encoder."""
    limit = truncation_limit(params, max_model_len)
    if isinstance(prompt, str) and prompt and limit is not None:
        text, ids = prompt, truncated_text_ids(tokenizer, prompt, limit)
    else:
        text, ids = encode(prompt)
        if limit is not None:
            ids = ids[:limit]
    if len(ids) > max_model_len:
        raise ValueError(f"the input has {len(ids)} tokens, more than this model's maximum of "
                         f"{max_model_len}; shorten it or set truncate_prompt_tokens")
    return text, ids


@dataclass
class _Pending:
    prompt: str | None
    token_ids: list[int]
    metrics: RequestMetrics


class EmbeddingRequests:
    """The embedding requests an engine has in flight, and their outputs."""

    def __init__(self) -> None:
        self.pending: dict[str, _Pending] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.pending

    def add(self, request_id: str, prompt: str | None, token_ids: list[int],
            arrival_time: float) -> None:
        self.pending[request_id] = _Pending(prompt, token_ids, RequestMetrics(arrival_time))

    def split(self, outputs: list[EngineCoreOutput]
              ) -> tuple[list[EmbeddingRequestOutput], list[EngineCoreOutput]]:
        """This step's finished embeddings, and the core outputs of the other requests."""
        if not self.pending:
            return [], outputs
        done: list[EmbeddingRequestOutput] = []
        rest: list[EngineCoreOutput] = []
        for out in outputs:
            if out.request_id not in self.pending:
                rest.append(out)
            elif out.pooled is not None:
                pending = self.pending.pop(out.request_id)
                pending.metrics.first_scheduled_time = out.first_scheduled_time
                done.append(self._output(out.request_id, pending, out.pooled, "stop"))
        return done, rest

    def abort(self, request_id: str) -> EmbeddingRequestOutput | None:
        """The final output of an embedding request dropped before it was computed."""
        pending = self.pending.pop(request_id, None)
        return None if pending is None else self._output(request_id, pending, [], "abort")

    @staticmethod
    def _output(request_id: str, pending: _Pending, embedding: list[float],
                finish_reason: str) -> EmbeddingRequestOutput:
        pending.metrics.finished_time = time.monotonic()
        return EmbeddingRequestOutput(request_id=request_id, prompt=pending.prompt,
                                      prompt_token_ids=pending.token_ids, embedding=embedding,
                                      metrics=pending.metrics, finish_reason=finish_reason)
