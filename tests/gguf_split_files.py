"""Test helper: a GGUF file written again as a split model by gguf's own split writer (the
shards llama.cpp's gguf-split makes: metadata in the first, split.* keys in each)."""

from __future__ import annotations

from pathlib import Path

import gguf

# Keys the writer sets itself (or that describe the file, not the model).
_OWN_KEYS = ("general.architecture", "general.alignment")


def write_split_copy(source: str, folder: Path, shards: int, stem: str = "model",
                     metadata_only_first: bool = False) -> list[Path]:
    """The GGUF file ``source`` again as ``shards`` files ``STEM-0000N-of-0000M.gguf`` in
    ``folder`` (metadata copied with its types, tensors copied raw with theirs; with
    ``metadata_only_first``, one more shard first holding no tensors, as gguf-split's
    ``--no-tensor-first-split`` writes); the shard paths, first first."""
    reader = gguf.GGUFReader(source)
    per_shard = -(-len(reader.tensors) // shards)
    writer = gguf.GGUFWriter(str(folder / f"{stem}.gguf"), reader.fields["general.architecture"]
                             .contents(), split_max_tensors=per_shard,
                             small_first_shard=metadata_only_first)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _OWN_KEYS:
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    paths = sorted(folder.glob(f"{stem}-*-of-*.gguf"))
    count = shards + metadata_only_first
    assert [p.name for p in paths] == [f"{stem}-{i:05d}-of-{count:05d}.gguf"
                                       for i in range(1, count + 1)]
    return paths
