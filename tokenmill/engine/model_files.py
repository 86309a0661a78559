"""What the server may know of a model's files without loading it: the files one model path
stands for. The server reaches the loaders through the engine's public modules only
(tests/unit/test_layers.py), so this is its door to the GGUF shard naming."""

from __future__ import annotations

from tokenmill.model_loader.gguf_split import split_shards


def model_files(path: str) -> list[str]:
    """The files of the model file ``path``: every shard of a split GGUF that exists (found by
    name, first first), else ``[path]``."""
    return split_shards(path)
