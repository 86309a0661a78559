"""Open a GGUF model that may be split over several files (llama.cpp's ``gguf-split``).

A split model is ``NAME-00001-of-00003.gguf``, ``NAME-00002-of-00003.gguf``, ...: each shard is
a complete GGUF file holding some of the tensors, the first one holds the model's metadata, and
every shard carries ``split.no`` (0-based), ``split.count`` and ``split.tensors.count`` (the
total). :func:`read_gguf` takes any shard (or a plain single file) and gives the metadata of the
first shard and the tensors of all of them, so loaders read a split model as one file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from tokenmill.model_loader.gguf_header import GGUFHeader, HeaderTensor

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
# gguf-split's shard names: PREFIX-00001-of-00003.gguf (five digits, 1-based).
_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class GGUFFiles:
    """A GGUF model as one file: ``fields`` (the first shard's metadata), ``tensors`` (every
    shard's, in shard then file order) and ``paths`` (the shards, first first; one for an
    unsplit file)."""

    fields: dict[str, Any]
    tensors: list[HeaderTensor]
    paths: list[str]


def shard_path(path: str, number: int) -> str:
    """The path of shard ``number`` (1-based) of the split model ``path`` belongs to;
    ValueError when ``path`` is not named like a shard."""
    folder, base = os.path.split(path)
    m = _SHARD_RE.match(base)
    if m is None:
        raise ValueError(f"{path!r} is not named like a split GGUF shard "
                         "(NAME-00001-of-00003.gguf)")
    suffix = base[m.end("count"):]  # keep the file's own spelling of ".gguf"
    name = f"{m.group('prefix')}-{number:05d}-of-{m.group('count')}{suffix}"
    return os.path.join(folder, name)


def split_shards(path: str) -> list[str]:
    """By name alone: the shards of the split model ``path`` is named as a shard of, those
    that exist, first first; ``[path]`` for any other name. For sizes and names, where the
    files need not be read (:func:`read_gguf` checks them)."""
    m = _SHARD_RE.match(os.path.basename(path))
    if m is None:
        return [path]
    shards = [shard_path(path, i) for i in range(1, int(m.group("count")) + 1)]
    return [p for p in shards if os.path.isfile(p)] or [path]


def _open(path: str) -> GGUFHeader:
    try:
        return GGUFHeader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def _split_count(header: GGUFHeader) -> int:
    return int(header.fields.get(SPLIT_COUNT, 1) or 1)


def read_gguf(path: str) -> GGUFFiles:
    """The metadata and tensors of the GGUF model at ``path``: a single file, or any shard of a
    split model (its sibling shards are found by name next to it). ValueError for an unreadable
    file, a missing shard (named in the message) or shards that do not belong together."""
    header = _open(path)
    count = _split_count(header)
    if count <= 1:
        return GGUFFiles(header.fields, list(header.tensors), [path])
    base = os.path.basename(path)
    m = _SHARD_RE.match(base)
    if m is None or int(m.group("count")) != count:
        raise ValueError(f"{path!r} is shard {int(header.fields.get(SPLIT_NO, 0)) + 1} of a GGUF "
                         f"split in {count} files, but is not named NAME-0000N-of-{count:05d}.gguf"
                         ", so its other shards cannot be found")
    paths = [shard_path(path, i) for i in range(1, count + 1)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"split GGUF model {paths[0]!r} has {count} shards but "
                         f"{', '.join(repr(p) for p in missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing")
    headers = [header if p == path else _open(p) for p in paths]
    tensors = _check_shards(paths, headers, count)
    return GGUFFiles(headers[0].fields, tensors, paths)


def _check_shards(paths: list[str], headers: list[GGUFHeader], count: int) -> list[HeaderTensor]:
    """Every shard's tensors, after checking each shard's ``split.*`` keys agree with its name
    and the total tensor count; ValueError naming the shard that disagrees."""
    tensors: list[HeaderTensor] = []
    seen: set[str] = set()
    for number, (p, h) in enumerate(zip(paths, headers, strict=True)):
        no, n = h.fields.get(SPLIT_NO), h.fields.get(SPLIT_COUNT)
        if no != number or n != count:
            raise ValueError(f"GGUF shard {p!r} says it is {SPLIT_NO}={no} of {SPLIT_COUNT}={n}; "
                             f"its name says {number} of {count}")
        for t in h.tensors:
            if t.name in seen:
                raise ValueError(f"tensor {t.name!r} is in more than one shard (again in {p!r})")
            seen.add(t.name)
        tensors += h.tensors
    expected = headers[0].fields.get(SPLIT_TENSORS)
    if expected is not None and int(expected) != len(tensors):
        raise ValueError(f"split GGUF model {paths[0]!r}: {SPLIT_TENSORS} is {expected} but its "
                         f"{count} shards hold {len(tensors)} tensors")
    return tensors
