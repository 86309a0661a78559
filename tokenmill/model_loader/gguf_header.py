"""A GGUF file's metadata and tensor table, read in one pass over the header.

`gguf.GGUFReader` (llama.cpp's reference reader) makes a numpy view for every value of every
metadata array: a 49,152-token vocabulary and its 48,900 merges are ~250,000 views, 5-9 s of
the embedded model's start-up on a 2-core VM. This reader decodes the same header with
``struct`` from one ``bytes`` copy of it (~0.1 s) and maps tensor data from a read-only
``np.memmap`` exactly as `GGUFReader` does (same shapes and dtypes), so everything downstream
(dequantization through ``gguf.quants``, the int4/int8 repacking) is unchanged.
tests/models/test_gguf.py checks it against `GGUFReader` field by field and tensor by tensor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Bytes read first; a header larger than this is read whole on a second try.
FIRST_READ = 16 << 20

# GGUF value types -> struct format of one value (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# Tensor types stored as plain numbers; every other type is blocks of bytes.
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor of the file: ``shape`` as GGUF lists it (innermost first), ``data`` a
    read-only view of its bytes in the file (numbers for plain types, uint8 blocks else)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    """Reads little-endian GGUF values from ``buf`` at ``pos``; IndexError past its end."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise IndexError("the header runs past the bytes read")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise IndexError("the header runs past the bytes read")
        text = self.buf[self.pos:end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            return self.array()
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.take(fmt)

    def array(self) -> list[Any]:
        itype, count = self.take("I"), self.take("Q")
        if itype in _NUMPY:
            dtype = np.dtype(_NUMPY[itype]).newbyteorder("<")
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise IndexError("the header runs past the bytes read")
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos = end
            return values
        if itype == 8:
            return [self.string() for _ in range(count)]
        return [self.value(itype) for _ in range(count)]


class GGUFHeader:
    """The metadata (``fields``: key -> Python value, as ``ReaderField.contents()`` gives it)
    and tensors (``tensors``, file order) of the GGUF file at ``path``; ValueError for a file
    that is not GGUF version 2 or 3."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            head = f.read(FIRST_READ)
            try:
                cursor, tensor_infos = self._parse(head)
            except IndexError:
                f.seek(0)
                try:
                    cursor, tensor_infos = self._parse(f.read())
                except IndexError:
                    raise ValueError("the header runs past the end of the file") from None
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment}: not a power of two")
        data_start = -(-cursor.pos // alignment) * alignment
        memmap = np.memmap(path, mode="r")
        self.tensors = [self._tensor(memmap, data_start, *info) for info in tensor_infos]

    def _parse(self, buf: bytes) -> tuple[_Cursor, list[tuple[str, list[int], int, int]]]:
        c = _Cursor(buf)
        if buf[:4] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        c.pos = 4
        version = c.take("I")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported "
                             f"(supported: {SUPPORTED_VERSIONS})")
        tensor_count, kv_count = c.take("Q"), c.take("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = c.string()
            if key in self.fields:
                raise ValueError(f"duplicate GGUF metadata key {key!r}")
            self.fields[key] = c.value(c.take("I"))
        infos = []
        for _ in range(tensor_count):
            name = c.string()
            dims = [c.take("Q") for _ in range(c.take("I"))]
            infos.append((name, dims, c.take("I"), c.take("Q")))
        return c, infos

    @staticmethod
    def _tensor(memmap: np.memmap, data_start: int, name: str, dims: list[int], raw_type: int,
                offset: int) -> HeaderTensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown GGML type {raw_type}") from None
        n_elems = int(np.prod(dims))
        np_dims = tuple(reversed(dims))
        start = data_start + offset
        if qtype in _PLAIN:
            dtype = np.dtype(_PLAIN[qtype])
            count = n_elems
        else:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            dtype, count = np.dtype(np.uint8), n_elems * type_size // block_size
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        end = start + count * dtype.itemsize
        if end > len(memmap):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = memmap[start:end].view(dtype).reshape(np_dims)
        return HeaderTensor(name, qtype, tuple(dims), data)
