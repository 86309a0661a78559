"""Test helper: write a one-layer GGUF file of given tensors (quantized with gguf's own code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
               *, hidden: int, ffn: int, heads: int, kv_heads: int, context_length: int,
               rms_eps: float, meta: dict[str, Any] | None = None) -> None:
    """``tensors``: GGUF name -> (float array, storage type); ``meta``: more GGUFWriter
    ``add_*`` calls, by method name."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(rms_eps)
    for key, value in (meta or {}).items():
        getattr(writer, key)(value)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
