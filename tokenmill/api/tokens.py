"""POST /tokenize and /detokenize: text or chat messages to token ids and back; GET
/tokenizer_info: the tokenizer's configuration."""

from __future__ import annotations

from typing import Any

from tokenmill.api.chat import MAX_CHAT_MESSAGES, TEMPLATE_ERRORS
from tokenmill.api.errors import bad_request
from tokenmill.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenmill.api.validation import ServedModel, check_token_ids
from tokenmill.model_loader.tokenizer_export import tokenizer_config


def tokenize(req: TokenizeRequest, served: ServedModel) -> TokenizeResponse:
    """The token ids of a prompt, or of chat messages rendered by the template; 400 names the
    bad field."""
    tok = served.tokenizer
    if req.messages is not None:
        if len(req.messages) > MAX_CHAT_MESSAGES:
            raise bad_request(f"messages: at most {MAX_CHAT_MESSAGES} messages, got "
                              f"{len(req.messages)}", "messages")
        try:
            _, ids = tok.encode_chat(req.messages,
                                     add_generation_prompt=req.add_generation_prompt)
        except TEMPLATE_ERRORS as e:
            raise bad_request(f"messages: {e}", "messages") from None
    elif req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        raise bad_request("send either prompt or messages", "prompt")
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=served.max_model_len)


def detokenize(req: DetokenizeRequest, served: ServedModel) -> DetokenizeResponse:
    """The text of token ids; 400 unless each is in the vocabulary."""
    check_token_ids(req.tokens, served.vocab_size, "tokens")
    return DetokenizeResponse(prompt=served.tokenizer.decode(req.tokens))


def tokenizer_info(served: ServedModel) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: what ``tokenizer_config.json`` holds for the served model's
    tokenizer (class, special tokens, chat template, added tokens, the served context length),
    the same as ``tokenmill tokenizer export`` writes."""
    return tokenizer_config(served.tokenizer, served.max_model_len)
