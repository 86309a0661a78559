"""How many tokens an Ollama request may generate: ``num_predict`` when it sets one, else
``DEFAULT_NUM_PREDICT`` within the room the context leaves (api/ollama.prepare_ollama), on the
embedded model's tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.api.ollama import (
    DEFAULT_NUM_PREDICT,
    chat_request,
    generate_request,
    prepare_ollama,
)
from tokenmill.model_loader.gguf import load_gguf_tokenizer
from tokenmill.tokenizer import Tokenizer


class Served:
    """What preparing a request reads of a served model."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, tokenizer.vocab_size
        self.max_model_len = max_model_len

    def compile_grammar(self, params: object) -> None:
        return None


@pytest.fixture(scope="module")
def tokenizer(smollm_path: str) -> Tokenizer:
    return load_gguf_tokenizer(smollm_path)


def max_tokens(tokenizer: Tokenizer, body: dict[str, Any], max_model_len: int) -> int | None:
    req = chat_request(body) if "messages" in body else generate_request(body)
    call = prepare_ollama(req, body, Served(tokenizer, max_model_len))
    return call.params.max_tokens


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}]}
RAW = {"model": "m", "prompt": "Once upon a time", "raw": True}
TEMPLATED = {"model": "m", "prompt": "Tell me a long story."}


@pytest.mark.parametrize("body", [CHAT, RAW, TEMPLATED])
def test_no_num_predict_is_the_default_within_the_context(tokenizer: Tokenizer,
                                                          body: dict[str, Any]) -> None:
    assert DEFAULT_NUM_PREDICT == 2048
    assert max_tokens(tokenizer, body, 32768) == DEFAULT_NUM_PREDICT
    assert max_tokens(tokenizer, {**body, "options": {"temperature": 0}}, 8192) == 2048
    # A context with less room than the default: all of that room, no 400.
    short = max_tokens(tokenizer, body, 100)
    assert short is not None and 50 < short < 100


@pytest.mark.parametrize("body", [CHAT, RAW, TEMPLATED])
def test_num_predict_says_it(tokenizer: Tokenizer, body: dict[str, Any]) -> None:
    assert max_tokens(tokenizer, {**body, "options": {"num_predict": 7}}, 32768) == 7
    assert max_tokens(tokenizer, {**body, "options": {"num_predict": 4000}}, 32768) == 4000
    # -1 and -2: until the context is full, as asked.
    for unlimited in (-1, -2):
        assert max_tokens(tokenizer, {**body, "options": {"num_predict": unlimited}},
                          32768) is None
