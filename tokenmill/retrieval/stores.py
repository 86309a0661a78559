"""The vector-store half of RetrievalService: stores, the files attached to them, file
batches, and the API-shaped search. Every request is checked whole before anything is
written, so a bad one (an unknown file among ten) leaves nothing half done."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from tokenmill.api.errors import bad_request
from tokenmill.api.files import ListPage, ListQuery, page
from tokenmill.api.protocol import now
from tokenmill.api.vector_stores import (
    ChunkingParam,
    Deleted,
    FileBatchCreate,
    FileBatchObject,
    FileContentPage,
    SearchPage,
    SearchRequest,
    SearchResultObject,
    TextContent,
    VectorStoreCreate,
    VectorStoreFileCreate,
    VectorStoreFileObject,
    VectorStoreObject,
    VectorStoreUpdate,
)
from tokenmill.retrieval.catalog import Catalog, FileRow, StoreFileRow, StoreRow
from tokenmill.retrieval.chunking import resolve_chunking
from tokenmill.retrieval.embedder import Embedder, max_text_chars
from tokenmill.retrieval.extract import check_supported
from tokenmill.retrieval.index import VectorIndex
from tokenmill.retrieval.ingest import Ingestor
from tokenmill.retrieval.objects import (
    batch_object,
    not_found,
    store_file_object,
    store_object,
)

T = TypeVar("T")
STORE_FILE_STATUSES = ("in_progress", "completed", "failed", "cancelled")


class StoreMethods:
    """Vector stores, their files and batches; RetrievalService provides the state."""

    catalog: Catalog
    index: VectorIndex
    ingest: Ingestor
    embedder: Embedder

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        raise NotImplementedError

    async def _file(self, file_id: str, param: str | None = None) -> FileRow:
        raise NotImplementedError

    async def search(self, vector_store_ids: list[str], query: str | list[str],
                     max_num_results: int = 10, filters: Any = None,
                     score_threshold: float = 0.0) -> list[Any]:
        raise NotImplementedError

    # --- stores --------------------------------------------------------------------------

    async def _store(self, store_id: str) -> StoreRow:
        row = await self.db(self.catalog.get_store, store_id)
        if row is None:
            raise not_found("vector store", store_id)
        return row

    async def _store_object(self, row: StoreRow) -> VectorStoreObject:
        return store_object(row, await self.db(self.catalog.store_stats, row.id), now())

    async def create_store(self, req: VectorStoreCreate) -> VectorStoreObject:
        """A new vector store, with ``req.file_ids`` attached (all checked first)."""
        chunking = resolve_chunking(req.chunking_strategy, self.embedder.max_input_tokens)
        for file_id in dict.fromkeys(req.file_ids):
            await self.check_attachable(file_id, "file_ids")
        t = now()
        row = StoreRow(f"vs_{uuid.uuid4().hex}", req.name or "", req.description, t, t,
                       req.metadata, req.expires_after.days if req.expires_after else None)
        await self.db(self.catalog.add_store, row)
        for file_id in dict.fromkeys(req.file_ids):
            await self._attach(row.id, file_id, None, chunking.max_tokens, chunking.overlap)
        return await self._store_object(row)

    async def get_store(self, store_id: str) -> VectorStoreObject:
        """A vector store; 404 if there is none."""
        return await self._store_object(await self._store(store_id))

    async def list_stores(self, q: ListQuery) -> ListPage[VectorStoreObject]:
        """A page of vector stores."""
        rows = await self.db(self.catalog.list_stores, q)
        objs = [await self._store_object(r) for r in rows]
        return page(objs, [r.id for r in rows], q.limit)

    async def update_store(self, store_id: str, req: VectorStoreUpdate) -> VectorStoreObject:
        """Change the name, metadata or expiry of a store (only the fields sent)."""
        row = await self._store(store_id)
        sent = req.model_fields_set
        if "name" in sent:
            row.name = req.name or ""
        if "metadata" in sent:
            row.metadata = req.metadata
        if "expires_after" in sent:
            row.expires_days = req.expires_after.days if req.expires_after else None
        row.last_active_at = now()
        await self.db(self.catalog.update_store, row)
        return await self._store_object(row)

    async def delete_store(self, store_id: str) -> Deleted:
        """Delete a store and its chunks; its files stay."""
        await self._store(store_id)
        self.ingest.cancel(store_id=store_id)
        await self.db(self._delete_store, store_id)
        return Deleted(id=store_id, object="vector_store.deleted")

    def _delete_store(self, store_id: str) -> None:
        self.catalog.delete_store(store_id)
        self.index.drop(store_id)

    # --- files of a store ----------------------------------------------------------------

    async def check_attachable(self, file_id: str, param: str) -> FileRow:
        """The file, or 404 if there is none, or 400 if file search cannot read its type."""
        row = await self._file(file_id, param)
        try:
            check_supported(row.filename)
        except ValueError as e:
            raise bad_request(str(e), param) from None
        return row

    async def _attach(self, store_id: str, file_id: str, attributes: dict[str, Any] | None,
                      max_tokens: int, overlap: int, batch_id: str | None = None
                      ) -> StoreFileRow:
        row = await self.db(self.catalog.get_store_file, store_id, file_id)
        if row is not None and row.status != "failed" and row.status != "cancelled":
            return row  # attached already: attaching again changes nothing
        if row is not None:  # a failed or cancelled attempt: try again from the start
            await self.db(self.catalog.delete_store_file, store_id, file_id)
        row = StoreFileRow(store_id, file_id, now(), "in_progress", None, None, attributes,
                           max_tokens, overlap, 0, batch_id)
        await self.db(self.catalog.add_store_file, row)
        self.ingest.start(store_id, file_id)
        return row

    async def attach_file(self, store_id: str, req: VectorStoreFileCreate
                          ) -> VectorStoreFileObject:
        """Attach an uploaded file; it is chunked, embedded and indexed in the background."""
        await self._store(store_id)
        chunking = self._chunking(req.chunking_strategy)
        await self.check_attachable(req.file_id, "file_id")
        row = await self._attach(store_id, req.file_id, req.attributes, chunking.max_tokens,
                                 chunking.overlap)
        return store_file_object(row)

    def _chunking(self, param: ChunkingParam | None) -> Any:
        return resolve_chunking(param, self.embedder.max_input_tokens)

    async def _store_file(self, store_id: str, file_id: str) -> StoreFileRow:
        await self._store(store_id)
        row = await self.db(self.catalog.get_store_file, store_id, file_id)
        if row is None:
            raise not_found("file", file_id)
        return row

    async def get_store_file(self, store_id: str, file_id: str) -> VectorStoreFileObject:
        """A file of a store, with its status."""
        return store_file_object(await self._store_file(store_id, file_id))

    async def list_store_files(self, store_id: str, q: ListQuery, status: str | None = None,
                               batch_id: str | None = None) -> ListPage[VectorStoreFileObject]:
        """A page of a store's (or one batch's) files, optionally of one status."""
        await self._store(store_id)
        if status is not None and status not in STORE_FILE_STATUSES:
            raise bad_request(f"filter must be one of {', '.join(STORE_FILE_STATUSES)}, got "
                              f"{status[:100]!r}", "filter")
        rows = await self.db(self.catalog.list_store_files, store_id, q, status, batch_id)
        return page([store_file_object(r) for r in rows], [r.file_id for r in rows], q.limit)

    async def update_store_file(self, store_id: str, file_id: str,
                                attributes: dict[str, Any] | None) -> VectorStoreFileObject:
        """Replace a file's attributes in a store."""
        await self._store_file(store_id, file_id)
        await self.db(self.catalog.set_attributes, store_id, file_id, attributes)
        return store_file_object(await self._store_file(store_id, file_id))

    async def detach_file(self, store_id: str, file_id: str) -> Deleted:
        """Remove a file and its chunks from a store (the file itself stays)."""
        await self._store_file(store_id, file_id)
        self.ingest.cancel(store_id, file_id)
        await self.db(self._detach, store_id, file_id)
        return Deleted(id=file_id, object="vector_store.file.deleted")

    def _detach(self, store_id: str, file_id: str) -> None:
        self.catalog.delete_store_file(store_id, file_id)
        self.index.remove_file(store_id, file_id)

    async def store_file_content(self, store_id: str, file_id: str) -> FileContentPage:
        """A file's chunks in a store, in order (overlaps included)."""
        await self._store_file(store_id, file_id)
        texts = await self.db(self.catalog.file_chunks, store_id, file_id)
        return FileContentPage(data=[TextContent(text=t) for t in texts])

    # --- batches -------------------------------------------------------------------------

    async def create_batch(self, store_id: str, req: FileBatchCreate) -> FileBatchObject:
        """Attach several files at once (each checked before any is attached)."""
        await self._store(store_id)
        entries = req.entries()
        plans = []
        for e in entries:
            chunking = self._chunking(e.chunking_strategy)
            await self.check_attachable(e.file_id, "files" if req.files else "file_ids")
            plans.append((e, chunking))
        batch_id, t = f"vsfb_{uuid.uuid4().hex}", now()
        await self.db(self.catalog.add_batch, batch_id, store_id, t)
        for e, chunking in plans:
            await self._attach(store_id, e.file_id, e.attributes, chunking.max_tokens,
                               chunking.overlap, batch_id)
        return await self.get_batch(store_id, batch_id)

    async def get_batch(self, store_id: str, batch_id: str) -> FileBatchObject:
        """A batch with its file counts; 404 if the store has no such batch."""
        await self._store(store_id)
        found = await self.db(self.catalog.get_batch, batch_id)
        if found is None or found[0] != store_id:
            raise not_found("file batch", batch_id)
        stats = await self.db(self.catalog.store_stats, store_id, batch_id)
        return batch_object(batch_id, store_id, found[1], found[2], stats)

    async def cancel_batch(self, store_id: str, batch_id: str) -> FileBatchObject:
        """Stop a batch's files that are still in progress."""
        await self.get_batch(store_id, batch_id)
        for row in await self.db(self.catalog.store_files, store_id, "in_progress"):
            if row.batch_id == batch_id:
                self.ingest.cancel(store_id, row.file_id)
        await self.db(self.catalog.cancel_batch, batch_id)
        return await self.get_batch(store_id, batch_id)

    # --- search --------------------------------------------------------------------------

    def _check_query_lengths(self, queries: list[str], is_list: bool) -> None:
        """400 for a query longer than the embedding model can read, before anything
        tokenizes it (a few megabytes would stall the server for seconds)."""
        tokens = self.embedder.max_input_tokens
        limit = max_text_chars(tokens)
        for i, q in enumerate(queries):
            if len(q) > limit:
                where = f"query[{i}]" if is_list else "query"
                raise bad_request(f"{where} has {len(q)} characters, more than the {limit} "
                                  f"that the embedding model's {tokens} tokens can hold",
                                  "query")

    async def search_page(self, store_id: str, req: SearchRequest) -> SearchPage:
        """``POST /v1/vector_stores/{id}/search`` answered."""
        threshold = req.ranking_options.score_threshold if req.ranking_options else 0.0
        self._check_query_lengths(req.queries(), isinstance(req.query, list))
        results = await self.search([store_id], req.queries(), req.max_num_results,
                                    req.filters, threshold)
        return SearchPage(search_query=req.queries(), data=[SearchResultObject(
            file_id=r.file_id, filename=r.filename, score=r.score, attributes=r.attributes,
            content=[TextContent(text=r.text)]) for r in results])
