"""``POST /v1/files``' multipart body, read as it streams in: the file part goes straight to a
file in the data folder and the upload is refused (413) the moment it passes the limit, so an
upload never sits in memory and an oversized one costs at most the limit in disk writes."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from tokenmill.api.errors import APIError, bad_request

logger = logging.getLogger(__name__)
# The form's other fields (purpose, expires_after[...]) are a few bytes each.
MAX_FIELD_BYTES = 64 << 10
# Multipart framing around the file: boundaries, part headers, the small fields.
ENVELOPE_BYTES = 256 << 10
# Bytes gathered before each write to disk (on a worker thread).
FLUSH_BYTES = 1 << 20


def too_large(limit: int) -> APIError:
    """413 for a file over ``--max-upload-bytes``."""
    return APIError(413, f"the file exceeds the upload limit of {limit} bytes "
                    "(--max-upload-bytes)", param="file", code="file_too_large")


@dataclass
class Upload:
    """What a multipart body held: the file (saved at ``path``) and the form fields."""

    path: str
    filename: str | None = None
    size: int = 0
    fields: dict[str, str] = field(default_factory=dict)


class _Parts:
    """python-multipart's callbacks: collects fields, queues the file's bytes for writing."""

    def __init__(self, upload: Upload, limit: int) -> None:
        self.upload = upload
        self.limit = limit
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.field_bytes = 0
        self._header_name = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._is_file = False
        self._value: list[bytes] = []
        # The closing boundary was read: python-multipart's finalize() does not check it.
        self.complete = False

    def callbacks(self) -> dict[str, object]:
        return {"on_part_begin": self._part_begin, "on_header_field": self._header_field,
                "on_header_value": self._header_val, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_done, "on_part_data": self._data,
                "on_part_end": self._part_end, "on_end": self._end}

    def _end(self) -> None:
        self.complete = True

    def _part_begin(self) -> None:
        self._headers, self._name, self._is_file, self._value = {}, None, False, []

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_val(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header_name.lower()] = self._header_value
        self._header_name, self._header_value = b"", b""

    def _headers_done(self) -> None:
        _, opts = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = opts.get(b"name")
        self._name = name.decode("utf-8", "replace") if name is not None else None
        filename = opts.get(b"filename")
        if self._name == "file":
            if self.upload.filename is not None:
                raise bad_request("send one file per upload", "file")
            self._is_file = True
            self.upload.filename = (filename or b"").decode("utf-8", "replace")

    def _data(self, data: bytes, start: int, end: int) -> None:
        n = end - start
        if self._is_file:
            self.upload.size += n
            if self.upload.size > self.limit:
                raise too_large(self.limit)
            self.pending.append(data[start:end])
            self.pending_bytes += n
        else:
            self.field_bytes += n
            if self.field_bytes > MAX_FIELD_BYTES:
                raise bad_request(f"the form's fields exceed {MAX_FIELD_BYTES} bytes")
            self._value.append(data[start:end])

    def _part_end(self) -> None:
        if not self._is_file and self._name is not None:
            self.upload.fields[self._name] = b"".join(self._value).decode("utf-8", "replace")


def _boundary(request: Request) -> bytes:
    media, opts = parse_options_header(request.headers.get("content-type", ""))
    if media != b"multipart/form-data" or not opts.get(b"boundary"):
        raise APIError(415, "upload the file as multipart/form-data (fields 'file' and "
                       "'purpose')", param="content-type", code="unsupported_media_type")
    return opts[b"boundary"]


def _dropped(upload: Upload) -> APIError:
    """Log a client that went away mid-upload in one line (a dropped connection is routine,
    not a server error) and answer 499, which nobody will read."""
    logger.info("upload dropped: the client disconnected after %d bytes of the file",
                upload.size)
    return APIError(499, "the client disconnected during the upload",
                    code="client_closed_request")


async def _next_chunk(stream: AsyncIterator[bytes], upload: Upload, idle_timeout: float
                      ) -> bytes | None:
    """The body's next bytes, or None at its end; 499 (one log line) if the client went
    away, 408 if nothing came for ``idle_timeout`` seconds."""
    try:
        return await asyncio.wait_for(stream.__anext__(), idle_timeout)
    except StopAsyncIteration:
        return None
    except ClientDisconnect:
        raise _dropped(upload) from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the upload stalled for {idle_timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None


def _write(path: str, chunks: list[bytes]) -> None:
    with open(path, "ab") as f:
        f.writelines(chunks)


async def receive_upload(request: Request, path: str, limit: int, idle_timeout: float
                         ) -> Upload:
    """Stream a multipart upload to ``path``: 415 if it is not multipart, 413 once the file
    passes ``limit`` bytes (or the declared length says it will), 408 if no data comes for
    ``idle_timeout`` seconds, 400 for a malformed body, one cut short (no closing boundary)
    or a missing file. A client that goes away mid-upload is one log line, not an error.
    On any error the partial file is removed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + ENVELOPE_BYTES:
        raise too_large(limit)
    upload = Upload(path)
    parts = _Parts(upload, limit)
    parser = MultipartParser(_boundary(request), parts.callbacks())  # type: ignore[arg-type]
    open(path, "wb").close()
    try:
        stream = request.stream().__aiter__()
        while (chunk := await _next_chunk(stream, upload, idle_timeout)) is not None:
            try:
                parser.write(chunk)
            except APIError:
                raise
            except Exception as e:  # python-multipart's errors: the body is malformed
                raise bad_request(f"malformed multipart body: {e}") from None
            if parts.pending_bytes >= FLUSH_BYTES:
                await asyncio.to_thread(_write, path, parts.pending)
                parts.pending, parts.pending_bytes = [], 0
        parser.finalize()
        if upload.filename is None:
            raise bad_request("the form has no 'file' field", "file")
        if not parts.complete:
            # A truncated body would otherwise be kept as if it were the whole file.
            raise bad_request("the multipart body ends before its closing boundary: the "
                              "upload is incomplete", "file")
        await asyncio.to_thread(_write, path, parts.pending)
        return upload
    except BaseException:
        if os.path.exists(path):
            os.unlink(path)
        raise
