"""OpenAI's Files API shapes (``/v1/files``) and the cursor pagination that every list of
files, vector stores and vector-store files shares."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.api.errors import bad_request

T = TypeVar("T")

FilePurpose = Literal["assistants", "assistants_output", "batch", "batch_output", "fine-tune",
                      "fine-tune-results", "vision", "user_data", "evals"]
FILE_PURPOSES: tuple[str, ...] = FilePurpose.__args__  # type: ignore[attr-defined]


class FileObject(BaseModel):
    """An uploaded file, as ``client.files.create/retrieve/list`` return it."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    # Deprecated by OpenAI but still in its shape: a stored file is always "processed" here.
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(BaseModel):
    """The answer to ``DELETE /v1/files/{id}``."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ListPage(BaseModel, Generic[T]):
    """OpenAI's cursor page: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ListQuery(BaseModel):
    """``limit``, ``order`` (by creation), ``after`` / ``before`` (an object id) of a list."""

    model_config = ConfigDict(frozen=True)

    limit: int = Field(default=20, ge=1)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None
    before: str | None = None


def list_query(limit: str | None, order: str | None, after: str | None, before: str | None,
               *, max_limit: int, default_limit: int) -> ListQuery:
    """The query parameters of a list request, checked; 400s name the parameter."""
    n = default_limit
    if limit is not None:
        if not limit.strip().isdigit() or not 1 <= int(limit) <= max_limit:
            raise bad_request(f"limit must be an integer in [1, {max_limit}], got {limit!r}",
                              "limit")
        n = int(limit)
    if order is not None and order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
    return ListQuery(limit=n, order=order or "desc", after=after or None, before=before or None)


def page(items: list[T], ids: list[str], limit: int) -> ListPage[T]:
    """One page from up to ``limit + 1`` items (the extra one only says there is more)."""
    data, more = items[:limit], len(items) > limit
    ids = ids[:limit]
    return ListPage[T](data=data, first_id=ids[0] if ids else None,
                       last_id=ids[-1] if ids else None, has_more=more)
