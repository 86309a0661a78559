"""Tokenizers for building workloads: a server's own tokenize/detokenize routes, or a local one.

Servers spell these routes differently; the first one that answers is used:

- tokenmill and vLLM: ``POST /tokenize {"prompt"}`` -> ``{"tokens"}``,
  ``POST /detokenize {"tokens"}`` -> ``{"prompt"}``
- llama.cpp's server: ``/tokenize {"content"}`` -> ``{"tokens"}``, ``/detokenize`` -> ``{"content"}``
- llama-cpp-python's server: ``/extras/tokenize {"input"}``, ``/extras/detokenize`` -> ``{"text"}``

The local fallback is tokenmill's Tokenizer on a GGUF file or a Hugging Face folder (by
default the embedded model's GGUF), which matches the server only when it serves that model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Dialect:
    """Paths and JSON keys of one server family's tokenizer routes."""

    name: str
    tokenize_path: str
    text_key: str
    detokenize_path: str
    detokenized_key: str


DIALECTS = (
    _Dialect("openai-extensions", "/tokenize", "prompt", "/detokenize", "prompt"),
    _Dialect("llama.cpp", "/tokenize", "content", "/detokenize", "content"),
    _Dialect("llama-cpp-python", "/extras/tokenize", "input", "/extras/detokenize", "text"),
)


class RemoteCodec:
    """A server's tokenizer over HTTP (synchronous: workloads are built before the run)."""

    def __init__(self, base_url: str, model: str, dialect: _Dialect,
                 headers: dict[str, str] | None = None) -> None:
        import httpx

        self.model, self.dialect = model, dialect
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=60)

    @classmethod
    def probe(cls, base_url: str, model: str,
              headers: dict[str, str] | None = None) -> RemoteCodec | None:
        """The server's tokenizer if one of the known dialects round-trips a word, else None."""
        import httpx

        for dialect in DIALECTS:
            codec = cls(base_url, model, dialect, headers)
            try:
                if codec.decode(codec.encode("hello")).strip() == "hello":
                    logger.info("tokenizing through the server (%s routes)", dialect.name)
                    return codec
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                pass
            codec.close()
        return None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self._http.post(path, json={"model": self.model, **body})
        r.raise_for_status()
        return r.json()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, as the server would count a completions prompt."""
        tokens = self._post(self.dialect.tokenize_path, {self.dialect.text_key: text})["tokens"]
        if not isinstance(tokens, list):
            raise ValueError("tokenize answered without a token list")
        return [t if isinstance(t, int) else t["id"] for t in tokens]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        body = self._post(self.dialect.detokenize_path, {"tokens": list(ids)})
        text = body[self.dialect.detokenized_key]
        if not isinstance(text, str):
            raise ValueError("detokenize answered without text")
        return text

    def close(self) -> None:
        self._http.close()


class LocalCodec:
    """tokenmill's Tokenizer on a GGUF file or a Hugging Face folder."""

    def __init__(self, path: str | None = None) -> None:
        from tokenmill.model_loader.gguf import embedded_model_path, load_gguf
        from tokenmill.tokenizer import Tokenizer

        self.path = path or embedded_model_path()
        if os.path.isdir(self.path):
            self.tokenizer = Tokenizer.from_hf_dir(self.path)
        elif os.path.isfile(self.path):
            self.tokenizer = load_gguf(self.path).tokenizer
        else:
            raise ValueError(f"--tokenizer {self.path!r} is neither a GGUF file nor a folder")

    def encode(self, text: str) -> list[int]:
        """Token ids with the model's own BOS/EOS settings, as a server adds them."""
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return self.tokenizer.decode(ids)
