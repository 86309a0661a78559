"""Catalog rows as the API's objects."""

from __future__ import annotations

from tokenmill.api.errors import APIError
from tokenmill.api.files import FileObject
from tokenmill.api.vector_stores import (
    ExpiresAfter,
    FileBatchObject,
    FileCounts,
    LastError,
    StaticChunking,
    StaticChunkingObject,
    VectorStoreFileObject,
    VectorStoreObject,
)
from tokenmill.retrieval.catalog import FileRow, StoreFileRow, StoreRow

DAY_S = 86400


def not_found(kind: str, ident: str, param: str | None = None) -> APIError:
    """404 in OpenAI's words."""
    return APIError(404, f"No {kind} found with id '{ident}'.", param=param, code="not_found")


def file_object(f: FileRow) -> FileObject:
    """An uploaded file."""
    return FileObject(id=f.id, bytes=f.bytes, created_at=f.created_at, filename=f.filename,
                      purpose=f.purpose)


def counts(stats: dict[str, int]) -> FileCounts:
    """File counts from ``Catalog.store_stats``."""
    keys = ("in_progress", "completed", "failed", "cancelled")
    return FileCounts(**{k: stats[k] for k in keys}, total=sum(stats[k] for k in keys))


def expires_at(s: StoreRow) -> int | None:
    """When a store expires (``expires_after`` days after it was last active), if it does."""
    return None if s.expires_days is None else s.last_active_at + s.expires_days * DAY_S


def store_object(s: StoreRow, stats: dict[str, int], now: int) -> VectorStoreObject:
    """A vector store with its file counts, bytes used and status."""
    until = expires_at(s)
    if until is not None and now >= until:
        status = "expired"
    else:
        status = "in_progress" if stats["in_progress"] else "completed"
    return VectorStoreObject(
        id=s.id, created_at=s.created_at, name=s.name, description=s.description,
        usage_bytes=stats["usage_bytes"], file_counts=counts(stats), status=status,
        expires_after=(None if s.expires_days is None else
                       ExpiresAfter(anchor="last_active_at", days=s.expires_days)),
        expires_at=until, last_active_at=s.last_active_at, metadata=s.metadata)


def store_file_object(f: StoreFileRow) -> VectorStoreFileObject:
    """A file attached to a store."""
    error = None
    if f.error_code is not None:
        error = LastError(code=f.error_code, message=f.error_message or "")  # type: ignore[arg-type]
    return VectorStoreFileObject(
        id=f.file_id, created_at=f.created_at, vector_store_id=f.store_id,
        usage_bytes=f.usage_bytes, status=f.status, last_error=error,  # type: ignore[arg-type]
        attributes=f.attributes,
        # Built without validation: ``auto`` may give less than static's minimum of 100 tokens
        # for a model that reads fewer.
        chunking_strategy=StaticChunkingObject(static=StaticChunking.model_construct(
            max_chunk_size_tokens=f.max_tokens, chunk_overlap_tokens=f.overlap)))


def batch_object(batch_id: str, store_id: str, created_at: int, cancelled: bool,
                 stats: dict[str, int]) -> FileBatchObject:
    """A file batch: in progress while any of its files is, then cancelled, failed (no file
    made it) or completed."""
    if stats["in_progress"]:
        status = "in_progress"
    elif cancelled and stats["cancelled"]:  # a cancel after every file was done changes nothing
        status = "cancelled"
    elif stats["failed"] and not stats["completed"]:
        status = "failed"
    else:
        status = "completed"
    return FileBatchObject(id=batch_id, created_at=created_at, vector_store_id=store_id,
                           status=status, file_counts=counts(stats))  # type: ignore[arg-type]
