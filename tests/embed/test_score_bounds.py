"""/v1/score and /v1/rerank on a cross-encoder bound each text before the pair is tokenized,
as /v1/embeddings does: a text longer than the model can read is refused (400 naming the
field and the limit) without reaching the tokenizer whole, or, truncated anyway, only its
start is read. The tokenizer is the embedded all-MiniLM-L6-v2's (a BERT pair template),
wrapped to count the characters each call is given."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.api.chat import MAX_CHARS_PER_TOKEN
from tokenmill.api.errors import APIError
from tokenmill.api.scores import RerankRequest, ScoreRequest, prepare_rerank, prepare_score
from tokenmill.model_loader import embedded_embedding_model_path
from tokenmill.tokenizer import Tokenizer

WORDS = "The keeper logs every passing ship and the height of the tide.\n"


class Counting:
    """A tokenizers.Tokenizer recording the characters of each encoding call."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.calls: list[int] = []

    def encode(self, text: str, *args: Any, **kw: Any) -> Any:
        self.calls.append(len(text) + (len(args[0]) if args and isinstance(args[0], str)
                                       else 0))
        return self._backend.encode(text, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class CrossEncoderFacts:
    """What prepare_score / prepare_rerank see of a cross-encoder engine."""

    task = "embed"
    cross_encoder = True
    max_model_len = 128
    embedding_size = 1

    def __init__(self) -> None:
        tok = Tokenizer.from_hf_dir(embedded_embedding_model_path())
        tok.backend.no_truncation()
        tok.backend.no_padding()
        tok._tok = Counting(tok._tok)  # type: ignore[attr-defined]
        self.tokenizer = tok
        self.vocab_size = tok.vocab_size

    @property
    def calls(self) -> list[int]:
        return self.tokenizer.backend.calls  # type: ignore[attr-defined,no-any-return]


def test_a_document_longer_than_the_model_can_read_is_refused_untokenized() -> None:
    served = CrossEncoderFacts()
    limit = served.max_model_len * MAX_CHARS_PER_TOKEN
    big = WORDS * (limit // len(WORDS) + 1)
    with pytest.raises(APIError) as exc:
        prepare_rerank(RerankRequest(query="tides", documents=["short", big]), served)
    err = exc.value
    assert err.status == 400 and err.param == "documents"
    assert "documents[1]" in err.message and str(limit) in err.message
    with pytest.raises(APIError) as exc:
        prepare_score(ScoreRequest(text_1=big, text_2="tides"), served)
    assert exc.value.status == 400 and exc.value.param == "text_1"
    assert all(n < len(big) for n in served.calls)
    # The next, normal request is answered: one prompt per pair.
    call = prepare_rerank(RerankRequest(query="tides", documents=["short", WORDS]), served)
    assert len(call.prompts) == 2


def test_a_truncated_pair_reads_only_the_start_of_a_long_text() -> None:
    served = CrossEncoderFacts()
    limit = served.max_model_len * MAX_CHARS_PER_TOKEN
    big = WORDS * (4 * limit // len(WORDS))
    call = prepare_rerank(RerankRequest(query="tides", documents=[big],
                                        truncate_prompt_tokens=-1), served)
    assert max(served.calls) <= limit + len("tides")
    assert len(call.prompts[0]["prompt_token_ids"]) == served.max_model_len
