"""Turning an attached file into indexed chunks, in the background: read, extract the text,
chunk, embed, then store chunks and vectors in one step. Each attachment is one task; a task
cut short by a shutdown leaves its file ``in_progress``, and the next start resumes it."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from tokenmill.retrieval.catalog import Catalog
from tokenmill.retrieval.chunking import Chunking, chunk_text
from tokenmill.retrieval.embedder import Embedder
from tokenmill.retrieval.extract import InvalidFile, UnsupportedFile, extract_text
from tokenmill.retrieval.index import VectorIndex, normalise

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Texts per embed call: large enough to batch well in the engine, small enough that a huge
# file does not hold one giant request.
EMBED_BATCH = 64


class Ingestor:
    """Runs ingestion tasks, at most ``max_concurrent`` at once; ``db`` runs a function on the
    thread that owns the catalog and the index."""

    def __init__(self, catalog: Catalog, index: VectorIndex, embedder: Embedder, files_dir: str,
                 db: Callable[..., Awaitable[Any]], max_concurrent: int = 2) -> None:
        self.catalog = catalog
        self.index = index
        self.embedder = embedder
        self.files_dir = files_dir
        self._db = db
        self._slots = asyncio.Semaphore(max_concurrent)
        self.tasks: dict[tuple[str, str], asyncio.Task[None]] = {}

    def start(self, store_id: str, file_id: str) -> None:
        """Ingest ``file_id`` into ``store_id`` in the background."""
        task = asyncio.get_running_loop().create_task(self._run(store_id, file_id))
        key = (store_id, file_id)
        self.tasks[key] = task
        task.add_done_callback(lambda t: self.tasks.pop(key, None)
                               if self.tasks.get(key) is t else None)

    def cancel(self, store_id: str | None = None, file_id: str | None = None) -> None:
        """Stop the tasks of a store, of a file, or of both."""
        for (s, f), task in list(self.tasks.items()):
            if (store_id is None or s == store_id) and (file_id is None or f == file_id):
                task.cancel()

    async def close(self) -> None:
        """Cancel every task and wait for them (their files stay in progress)."""
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait(self) -> None:
        """Wait until no task runs (tests, benchmarks)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks.values()), return_exceptions=True)

    async def _run(self, store_id: str, file_id: str) -> None:
        async with self._slots:
            error: tuple[str, str] | None = None
            try:
                await self._ingest(store_id, file_id)
                return
            except UnsupportedFile as e:
                error = ("unsupported_file", str(e))
            except InvalidFile as e:
                error = ("invalid_file", str(e))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the model or the disk failed: say so on the file
                logger.exception("ingesting %s into %s failed", file_id, store_id)
                error = ("server_error", f"{type(e).__name__}: {e}")
            await self._db(self._fail, store_id, file_id, error)

    def _fail(self, store_id: str, file_id: str, error: tuple[str, str]) -> None:
        row = self.catalog.get_store_file(store_id, file_id)
        if row is not None and row.status == "in_progress":
            self.catalog.finish_store_file(store_id, file_id, "failed", error)

    async def _ingest(self, store_id: str, file_id: str) -> None:
        row = await self._db(self.catalog.get_store_file, store_id, file_id)
        file = await self._db(self.catalog.get_file, file_id)
        if row is None or file is None or row.status != "in_progress":
            return
        chunks, text_bytes = await asyncio.to_thread(self._chunks, file_id, file.filename,
                                                     Chunking(row.max_tokens, row.overlap))
        # Each batch becomes float32 at once: a whole file's vectors as Python floats take
        # 32 bytes a number, and converting them in one call would block the event loop.
        batches: list[np.ndarray] = []
        for start in range(0, len(chunks), EMBED_BATCH):
            texts = chunks[start:start + EMBED_BATCH]
            batch = np.array(await self.embedder.embed(texts), dtype=np.float32)
            if batch.ndim != 2 or batch.shape[0] != len(texts):
                raise RuntimeError(f"the embedder returned {batch.shape} for {len(texts)} "
                                   "texts")
            batches.append(normalise(batch))
        matrix = await asyncio.to_thread(np.concatenate, batches)
        await self._db(self._commit, store_id, file_id, chunks, matrix,
                       text_bytes + matrix.nbytes)

    def _chunks(self, file_id: str, filename: str, chunking: Chunking) -> tuple[list[str], int]:
        """The file's chunks and their size in bytes (UTF-8)."""
        with open(os.path.join(self.files_dir, file_id), "rb") as f:
            data = f.read()
        text = extract_text(data, filename)
        del data
        chunks = [c.text for c in chunk_text(text, self.embedder.token_spans, chunking)]
        if not chunks:
            raise InvalidFile(f"{filename!r} holds no text the embedding model can read")
        return chunks, sum(len(c.encode()) for c in chunks)

    def _commit(self, store_id: str, file_id: str, chunks: list[str], matrix: np.ndarray,
                usage: int) -> None:
        # Loaded before the chunks are committed, so that they are indexed exactly once.
        self.index.check_dim(store_id, matrix.shape[1])
        ids = self.catalog.add_chunks(store_id, file_id, chunks, matrix, usage)
        if ids is not None:
            self.index.add(store_id, file_id, ids, matrix)
