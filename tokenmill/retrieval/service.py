"""RetrievalService: files, vector stores and search over them, kept under one data folder.

Every read and write of the catalog (SQLite) and the vector indexes (FAISS) runs on one
dedicated thread, in the order the calls arrive: concurrent uploads, attachments and searches
never see each other half done, and the event loop never waits on the disk. Text extraction,
chunking and the embedding model run outside that thread.
"""

from __future__ import annotations

import asyncio
import functools
import glob
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tokenmill.api.errors import bad_request
from tokenmill.api.files import FILE_PURPOSES, FileDeleted, FileObject, ListPage, ListQuery, page
from tokenmill.api.protocol import now
from tokenmill.api.vector_stores import MAX_SEARCH_RESULTS, Filter
from tokenmill.retrieval.catalog import Catalog, FileRow
from tokenmill.retrieval.embedder import Embedder
from tokenmill.retrieval.extract import extract_text
from tokenmill.retrieval.filters import matches
from tokenmill.retrieval.index import VectorIndex, normalise, one_thread_faiss
from tokenmill.retrieval.ingest import Ingestor
from tokenmill.retrieval.objects import file_object, not_found
from tokenmill.retrieval.stores import StoreMethods

T = TypeVar("T")
MAX_FILENAME_CHARS = 255


def default_data_dir() -> str:
    """Where files and vector stores live without ``--data-dir``: ``tokenmill`` in the user's
    data folder (``~/.local/share/tokenmill`` on Linux)."""
    import platformdirs

    return platformdirs.user_data_dir("tokenmill", appauthor=False)


@dataclass(frozen=True)
class SearchResult:
    """One chunk found by a search: the file it comes from, its cosine similarity to the
    query (in [-1, 1]; higher is closer), its text and the file's attributes."""

    file_id: str
    filename: str
    score: float
    text: str
    attributes: dict[str, Any] | None
    vector_store_id: str


class RetrievalService(StoreMethods):
    """Files, vector stores and search, stored under ``data_dir``, embedded by ``embedder``.
    Vector-store methods live in stores.py's StoreMethods, which this class includes."""

    def __init__(self, data_dir: str, embedder: Embedder, *, max_concurrent_ingest: int = 2
                 ) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.files_dir = os.path.join(self.data_dir, "files")
        os.makedirs(self.files_dir, exist_ok=True)
        self.embedder = embedder
        # One thread owns the catalog and the indexes; FAISS searches one query at a time
        # there, where OpenMP's thread start-up costs more than it saves.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-retrieval",
                                          initializer=one_thread_faiss)
        self.catalog = Catalog(os.path.join(self.data_dir, "retrieval.sqlite"))
        self.index = VectorIndex(self.catalog.store_vectors)
        self.ingest = Ingestor(self.catalog, self.index, embedder, self.files_dir, self.db,
                               max_concurrent_ingest)
        self._started = False

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the catalog's thread."""
        await self.start()
        return await self._on_thread(fn, *args)

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args))

    async def start(self) -> None:
        """Resume the ingestion that a stop cut short, and drop half-written uploads. Called
        by the first request if nobody calls it before."""
        if self._started:
            return
        self._started = True
        for partial in glob.glob(os.path.join(self.files_dir, ".upload-*")):
            os.unlink(partial)
        for row in await self._on_thread(self.catalog.store_files, "*", "in_progress"):
            self.ingest.start(row.store_id, row.file_id)

    async def close(self) -> None:
        """Stop ingestion (it resumes at the next start) and close the database."""
        await self.ingest.close()
        await self._on_thread(self.catalog.close)
        self._thread.shutdown(wait=True)

    # --- files ---------------------------------------------------------------------------

    def upload_path(self) -> str:
        """A fresh path in the data folder for an upload being received."""
        return os.path.join(self.files_dir, f".upload-{uuid.uuid4().hex}")

    async def create_file(self, upload: str, filename: str, purpose: str,
                          size: int) -> FileObject:
        """Keep the upload at ``upload`` (moved, not copied) as a new file; 400 for an empty
        file, an unknown purpose, or (purpose ``assistants``, meant for file search) a file
        whose text cannot be read. The upload is removed whatever happens."""
        try:
            name = os.path.basename(filename.replace("\\", "/")).strip()
            if not name or len(name) > MAX_FILENAME_CHARS:
                raise bad_request(f"the file name must have 1 to {MAX_FILENAME_CHARS} "
                                  f"characters, got {filename[:300]!r}", "file")
            if purpose not in FILE_PURPOSES:
                raise bad_request(f"purpose must be one of {', '.join(FILE_PURPOSES)}, got "
                                  f"{purpose[:100]!r}", "purpose")
            if size == 0:
                raise bad_request(f"{name!r} is empty", "file")
            if purpose == "assistants":
                await asyncio.to_thread(self._check_text, upload, name)
            row = FileRow(f"file-{uuid.uuid4().hex}", name, size, purpose, now())
            os.replace(upload, os.path.join(self.files_dir, row.id))
            await self.db(self.catalog.add_file, row)
            return file_object(row)
        finally:
            if os.path.exists(upload):
                os.unlink(upload)

    @staticmethod
    def _check_text(path: str, name: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        try:
            extract_text(data, name)
        except ValueError as e:
            raise bad_request(str(e), "file") from None

    async def get_file(self, file_id: str) -> FileObject:
        """A file; 404 if there is none."""
        return file_object(await self._file(file_id))

    async def _file(self, file_id: str, param: str | None = None) -> FileRow:
        row = await self.db(self.catalog.get_file, file_id)
        if row is None:
            raise not_found("file", file_id, param)
        return row

    async def list_files(self, q: ListQuery, purpose: str | None = None) -> ListPage[FileObject]:
        """A page of files, newest first unless ``q.order`` is ``asc``."""
        rows = await self.db(self.catalog.list_files, q, purpose)
        return page([file_object(r) for r in rows], [r.id for r in rows], q.limit)

    async def file_path(self, file_id: str) -> tuple[str, str]:
        """(path of the bytes, file name) of a file; 404 if there is none."""
        row = await self._file(file_id)
        return os.path.join(self.files_dir, row.id), row.filename

    async def delete_file(self, file_id: str) -> FileDeleted:
        """Delete a file and remove it, with its chunks, from every vector store."""
        await self._file(file_id)
        self.ingest.cancel(file_id=file_id)
        await self.db(self._delete_file, file_id)
        return FileDeleted(id=file_id)

    def _delete_file(self, file_id: str) -> None:
        for store_id in self.catalog.delete_file(file_id):
            self.index.remove_file(store_id, file_id)
        path = os.path.join(self.files_dir, file_id)
        if os.path.exists(path):
            os.unlink(path)

    # --- search --------------------------------------------------------------------------

    async def search(self, vector_store_ids: list[str], query: str | list[str],
                     max_num_results: int = 10, filters: Filter | None = None,
                     score_threshold: float = 0.0) -> list[SearchResult]:
        """The chunks closest to ``query`` (several queries: a chunk scores its best) in the
        given stores, best first, only of files whose attributes pass ``filters`` and only
        with a score of at least ``score_threshold``. 400 for an empty query or a bad count,
        404 for an unknown store."""
        queries = [query] if isinstance(query, str) else list(query)
        if not queries or any(not q.strip() for q in queries):
            raise bad_request("query must not be empty", "query")
        if not 1 <= max_num_results <= MAX_SEARCH_RESULTS:
            raise bad_request(f"max_num_results must be in [1, {MAX_SEARCH_RESULTS}], got "
                              f"{max_num_results}", "max_num_results")
        for store_id in vector_store_ids:
            if await self.db(self.catalog.get_store, store_id) is None:
                raise not_found("vector store", store_id, "vector_store_ids")
        vectors = normalise(np.array(await self.embedder.embed(queries), dtype=np.float32))
        return await self.db(self._search, list(dict.fromkeys(vector_store_ids)), vectors,
                             max_num_results, filters, score_threshold)

    def _search(self, store_ids: list[str], vectors: np.ndarray, k: int,
                filters: Filter | None, threshold: float) -> list[SearchResult]:
        hits: list[tuple[float, str, int]] = []
        attrs: dict[str, dict[str, dict[str, Any] | None]] = {}
        for store_id in store_ids:
            self.catalog.touch_store(store_id, now())
            idx = self.index.get(store_id)
            if idx is None:
                continue
            rows = self.catalog.store_files(store_id, "completed")
            attrs[store_id] = {r.file_id: r.attributes for r in rows}
            allowed = None if filters is None else {
                f for f, a in attrs[store_id].items() if matches(filters, a)}
            hits.extend((score, store_id, cid) for cid, score in idx.search(vectors, k, allowed)
                        if score >= threshold)
        hits = sorted(hits, key=lambda h: -h[0])[:k]
        texts = self.catalog.chunk_texts([h[2] for h in hits])
        names: dict[str, str] = {}
        out = []
        for score, store_id, cid in hits:
            file_id, text = texts[cid]
            if file_id not in names:
                row = self.catalog.get_file(file_id)
                names[file_id] = row.filename if row else ""
            out.append(SearchResult(file_id, names[file_id], round(float(score), 6), text,
                                    attrs[store_id].get(file_id), store_id))
        return out
