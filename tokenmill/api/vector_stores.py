"""OpenAI's Vector Stores API shapes: vector stores, their files and file batches, chunking
strategies, attribute filters and search. Requests are strict (see protocol.py): a 400 names
the first bad field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from tokenmill.api.protocol import StrictModel

# OpenAI's chunking limits and its ``auto`` strategy's sizes.
MIN_CHUNK_TOKENS = 100
MAX_CHUNK_TOKENS = 4096
AUTO_CHUNK_TOKENS = 800
AUTO_OVERLAP_TOKENS = 400
MAX_SEARCH_RESULTS = 50
# Attributes and metadata: at most 16 keys of 64 characters, strings of 512.
MAX_KEYS = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512
MAX_FILES_PER_REQUEST = 2000

# int before float: an integer attribute comes back as the integer it was.
Scalar = str | bool | int | float


def _check_map(value: dict[str, Any] | None, what: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if len(value) > MAX_KEYS:
        raise ValueError(f"{what} may have at most {MAX_KEYS} keys, got {len(value)}")
    for k, v in value.items():
        if len(k) > MAX_KEY_CHARS:
            raise ValueError(f"{what} key {k[:80]!r} is longer than {MAX_KEY_CHARS} characters")
        if isinstance(v, str) and len(v) > MAX_VALUE_CHARS:
            raise ValueError(f"{what}[{k!r}] is longer than {MAX_VALUE_CHARS} characters")
    return value


Metadata = dict[str, str]
Attributes = dict[str, Scalar]


# --- chunking ---------------------------------------------------------------------------

class StaticChunking(StrictModel):
    """Fixed windows of ``max_chunk_size_tokens`` that overlap by ``chunk_overlap_tokens``."""

    max_chunk_size_tokens: int = Field(ge=MIN_CHUNK_TOKENS, le=MAX_CHUNK_TOKENS)
    chunk_overlap_tokens: int = Field(ge=0)

    @model_validator(mode="after")
    def _overlap_at_most_half(self) -> StaticChunking:
        if self.chunk_overlap_tokens > self.max_chunk_size_tokens // 2:
            raise ValueError(f"chunk_overlap_tokens ({self.chunk_overlap_tokens}) must not "
                             f"exceed half of max_chunk_size_tokens "
                             f"({self.max_chunk_size_tokens})")
        return self


class AutoChunkingParam(StrictModel):
    type: Literal["auto"]


class StaticChunkingParam(StrictModel):
    type: Literal["static"]
    static: StaticChunking


ChunkingParam = Annotated[AutoChunkingParam | StaticChunkingParam,
                          Field(discriminator="type")]


class StaticChunkingObject(BaseModel):
    """The strategy a file was chunked with, as the API reports it."""

    type: Literal["static"] = "static"
    static: StaticChunking


# --- filters ----------------------------------------------------------------------------

class ComparisonFilter(StrictModel):
    """``{"key", "type": eq|ne|gt|gte|lt|lte|in|nin, "value"}`` on a file's attributes."""

    key: str = Field(min_length=1)
    type: Literal["eq", "ne", "gt", "gte", "lt", "lte", "in", "nin"]
    value: str | bool | int | float | list[str | int | float]

    @model_validator(mode="after")
    def _value_fits_type(self) -> ComparisonFilter:
        listed = isinstance(self.value, list)
        if self.type in ("in", "nin") and not listed:
            raise ValueError(f"'{self.type}' compares with a list of values")
        if self.type not in ("in", "nin") and listed:
            raise ValueError(f"'{self.type}' compares with one value, not a list")
        if self.type in ("gt", "gte", "lt", "lte") and (
                isinstance(self.value, bool) or not isinstance(self.value, (int, float, str))):
            raise ValueError(f"'{self.type}' compares with a number or a string")
        return self


class CompoundFilter(StrictModel):
    """``{"type": "and"|"or", "filters": [...]}`` of comparison or compound filters."""

    type: Literal["and", "or"]
    filters: list[Filter] = Field(min_length=1)


Filter = Annotated[ComparisonFilter | CompoundFilter, Field(discriminator="type")]
CompoundFilter.model_rebuild()


# --- requests ---------------------------------------------------------------------------

class ExpiresAfter(StrictModel):
    anchor: Literal["last_active_at"]
    days: int = Field(ge=1, le=365)


class _WithMetadata(StrictModel):
    metadata: Metadata | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: Metadata | None) -> Metadata | None:
        return _check_map(v, "metadata")


class VectorStoreCreate(_WithMetadata):
    """``POST /v1/vector_stores``."""

    name: str | None = None
    description: str | None = None
    file_ids: list[str] = Field(default_factory=list, max_length=MAX_FILES_PER_REQUEST)
    chunking_strategy: ChunkingParam | None = None
    expires_after: ExpiresAfter | None = None


class VectorStoreUpdate(_WithMetadata):
    """``POST /v1/vector_stores/{id}``: only the fields sent change."""

    name: str | None = None
    expires_after: ExpiresAfter | None = None


class _WithAttributes(StrictModel):
    attributes: Attributes | None = None
    chunking_strategy: ChunkingParam | None = None

    @field_validator("attributes")
    @classmethod
    def _attribute_limits(cls, v: Attributes | None) -> Attributes | None:
        return _check_map(v, "attributes")


class VectorStoreFileCreate(_WithAttributes):
    """``POST /v1/vector_stores/{id}/files``: attach an uploaded file."""

    file_id: str = Field(min_length=1)


class VectorStoreFileUpdate(StrictModel):
    """``POST /v1/vector_stores/{id}/files/{file_id}``: replace the attributes."""

    attributes: Attributes | None

    @field_validator("attributes")
    @classmethod
    def _attribute_limits(cls, v: Attributes | None) -> Attributes | None:
        return _check_map(v, "attributes")


class BatchFile(_WithAttributes):
    file_id: str = Field(min_length=1)


class FileBatchCreate(_WithAttributes):
    """``POST /v1/vector_stores/{id}/file_batches``: ``file_ids`` or ``files``, not both."""

    file_ids: list[str] | None = Field(default=None, max_length=MAX_FILES_PER_REQUEST)
    files: list[BatchFile] | None = Field(default=None, max_length=MAX_FILES_PER_REQUEST)

    @model_validator(mode="after")
    def _one_list(self) -> FileBatchCreate:
        if (self.file_ids is None) == (self.files is None):
            raise ValueError("send exactly one of file_ids and files")
        if not (self.file_ids or self.files):
            raise ValueError("the batch holds no file")
        return self

    def entries(self) -> list[BatchFile]:
        """Each file with its own attributes and chunking (the batch-wide ones for file_ids)."""
        if self.files is not None:
            return self.files
        return [BatchFile(file_id=f, attributes=self.attributes,
                          chunking_strategy=self.chunking_strategy)
                for f in self.file_ids or []]


class RankingOptions(StrictModel):
    ranker: Literal["none", "auto", "default-2024-11-15"] | None = None
    score_threshold: float = Field(default=0.0, ge=0.0, le=1.0)


class SearchRequest(StrictModel):
    """``POST /v1/vector_stores/{id}/search``."""

    query: str | list[str]
    max_num_results: int = Field(default=10, ge=1, le=MAX_SEARCH_RESULTS)
    filters: Filter | None = None
    ranking_options: RankingOptions | None = None
    rewrite_query: bool = False

    @field_validator("query")
    @classmethod
    def _not_empty(cls, v: str | list[str]) -> str | list[str]:
        queries = [v] if isinstance(v, str) else v
        if not queries:
            raise ValueError("the query list is empty")
        if any(not q.strip() for q in queries):
            raise ValueError("a query is empty")
        return v

    def queries(self) -> list[str]:
        """The query as a list."""
        return [self.query] if isinstance(self.query, str) else list(self.query)


# --- responses --------------------------------------------------------------------------

class FileCounts(BaseModel):
    in_progress: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    total: int = 0


class VectorStoreObject(BaseModel):
    """A vector store, as ``client.vector_stores.create/retrieve/list`` return it."""

    id: str
    object: Literal["vector_store"] = "vector_store"
    created_at: int
    name: str
    description: str | None = None
    usage_bytes: int
    file_counts: FileCounts
    status: Literal["expired", "in_progress", "completed"]
    expires_after: ExpiresAfter | None = None
    expires_at: int | None = None
    last_active_at: int | None = None
    metadata: Metadata | None = None


class Deleted(BaseModel):
    """``{"id", "object": "<kind>.deleted", "deleted": true}``."""

    id: str
    object: str
    deleted: bool = True


class LastError(BaseModel):
    code: Literal["server_error", "unsupported_file", "invalid_file"]
    message: str


class VectorStoreFileObject(BaseModel):
    """A file attached to a vector store, with its ingestion status."""

    id: str
    object: Literal["vector_store.file"] = "vector_store.file"
    created_at: int
    vector_store_id: str
    usage_bytes: int
    status: Literal["in_progress", "completed", "cancelled", "failed"]
    last_error: LastError | None = None
    attributes: Attributes | None = None
    chunking_strategy: StaticChunkingObject | None = None


class FileBatchObject(BaseModel):
    """A batch of files attached together."""

    id: str
    object: Literal["vector_store.files_batch"] = "vector_store.files_batch"
    created_at: int
    vector_store_id: str
    status: Literal["in_progress", "completed", "cancelled", "failed"]
    file_counts: FileCounts


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class SearchResultObject(BaseModel):
    """One search hit: a chunk of a file."""

    file_id: str
    filename: str
    score: float
    attributes: Attributes | None = None
    content: list[TextContent]


class SearchPage(BaseModel):
    """The answer to a search."""

    object: Literal["vector_store.search_results.page"] = "vector_store.search_results.page"
    search_query: list[str]
    data: list[SearchResultObject]
    has_more: bool = False
    next_page: str | None = None


class FileContentPage(BaseModel):
    """``GET /v1/vector_stores/{id}/files/{file_id}/content``: the file's extracted text."""

    object: Literal["vector_store.file_content.page"] = "vector_store.file_content.page"
    data: list[TextContent]
    has_more: bool = False
    next_page: str | None = None
