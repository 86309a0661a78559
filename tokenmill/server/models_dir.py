"""The folder of models a server loads from (--models-dir): paths kept inside it, sizes on
disk, and how many models fit the machine at once."""

from __future__ import annotations

import os

from tokenmill.api.errors import APIError, bad_request
from tokenmill.engine.model_files import model_files


def default_max_loaded_models(at_start: int) -> int:
    """--max-loaded-models by default: the models loaded at start, and one on-demand model
    per 8 GiB of the machine's memory (1 to 3; Ollama's default on the CPU is 3)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 8 << 30
    return at_start + min(max(memory // (8 << 30), 1), 3)


def size_on_disk(path: str) -> int:
    """Bytes of a model file (every shard of a split GGUF), or of every file in a folder."""
    if not os.path.isdir(path):
        return sum(os.path.getsize(p) for p in model_files(path))
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def path_inside(models_dir: str | None, path: str, param: str) -> str:
    """``path`` inside ``models_dir`` (a real path; relative paths are taken from it), or as
    given without one; 400 naming ``param`` for an empty path or one that is not in the
    folder. The answer is the same for a path outside it and one missing in it: a request
    learns nothing about the rest of the disk."""
    if not isinstance(path, str) or not path:
        raise bad_request(f"{param} must be a non-empty string", param)
    if models_dir is None:
        return path
    full = os.path.realpath(os.path.join(models_dir, path))
    if os.path.commonpath([full, models_dir]) != models_dir or not os.path.exists(full):
        raise APIError(400, f"{param} {path!r}: not found in the models folder (--models-dir)",
                       param=param, code="path_not_found")
    return full
