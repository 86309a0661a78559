"""The pooling a model folder's sentence-transformers files ask for.

``modules.json`` lists the pipeline: a Transformer, a Pooling (its ``config.json`` says how
token states become one vector) and optionally a Normalize. ``sentence_bert_config.json``
holds ``max_seq_length``, the longest input the model was trained for. Modules this engine
does not compute (a Dense projection, weighted-mean pooling...) are errors, not silently
different embeddings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tokenmill.models.pooler import PoolerConfig

# Pooling config.json flags -> our method name.
_MODE_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}
_UNSUPPORTED_FLAGS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
# The newer single-string spelling ("pooling_mode": "mean").
_MODE_NAMES = {"cls": "cls", "mean": "mean", "max": "max", "lasttoken": "last"}
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class SentenceTransformerInfo:
    """What a folder's sentence-transformers files say: pooling, normalisation, length."""

    pooler: PoolerConfig
    max_seq_length: int | None


def _read(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from None


def _pooling_method(config: dict[str, Any], path: str) -> str:
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        if mode not in _MODE_NAMES:
            raise ValueError(f"{path!r}: pooling_mode {mode!r} is not supported")
        return _MODE_NAMES[mode]
    for flag in _UNSUPPORTED_FLAGS:
        if config.get(flag):
            raise ValueError(f"{path!r}: {flag} is not supported")
    chosen = [method for flag, method in _MODE_FLAGS.items() if config.get(flag)]
    if len(chosen) != 1:
        raise ValueError(f"{path!r} must turn on exactly one pooling mode of "
                         f"{', '.join(_MODE_FLAGS)}, got {len(chosen)}")
    return chosen[0]


def read_sentence_transformer(folder: str) -> SentenceTransformerInfo | None:
    """The folder's pooling and length from its sentence-transformers files; None without a
    ``modules.json``. ValueError for a pipeline this engine cannot reproduce."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _read(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path!r} must hold a list of modules")
    method: str | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _KNOWN_MODULES:
            raise ValueError(f"{modules_path!r}: module {module.get('type')!r} is not "
                             f"supported (only {', '.join(_KNOWN_MODULES)})")
        if kind == "Pooling":
            pooling_path = os.path.join(folder, str(module.get("path", "")), "config.json")
            method = _pooling_method(_read(pooling_path), pooling_path)
        elif kind == "Normalize":
            normalize = True
    if method is None:
        raise ValueError(f"{modules_path!r} has no Pooling module")
    length = None
    bert_config = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(bert_config):
        length = _read(bert_config).get("max_seq_length")
        if length is not None and (not isinstance(length, int) or length <= 0):
            raise ValueError(f"{bert_config!r}: max_seq_length must be a positive integer")
    return SentenceTransformerInfo(PoolerConfig(method, normalize), length)
