"""The SQLite database under ``--data-dir``: files, vector stores, which files each store holds
(with status and attributes), file batches, and every chunk's text and embedding. It is the
source of truth; the FAISS indexes (index.py) are rebuilt from it after a restart.

Not thread-safe by itself: RetrievalService calls it from one thread only.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.api.errors import bad_request
from tokenmill.api.files import ListQuery

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, purpose TEXT NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS stores (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, name TEXT NOT NULL,
    description TEXT, created_at INTEGER NOT NULL, last_active_at INTEGER NOT NULL,
    metadata TEXT, expires_days INTEGER);
CREATE TABLE IF NOT EXISTS store_files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, store_id TEXT NOT NULL, file_id TEXT NOT NULL,
    created_at INTEGER NOT NULL, status TEXT NOT NULL, error_code TEXT, error_message TEXT,
    attributes TEXT, max_tokens INTEGER NOT NULL, overlap INTEGER NOT NULL,
    usage_bytes INTEGER NOT NULL DEFAULT 0, batch_id TEXT, UNIQUE (store_id, file_id));
CREATE INDEX IF NOT EXISTS store_files_batch ON store_files (batch_id);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, store_id TEXT NOT NULL,
    created_at INTEGER NOT NULL, cancelled INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT, store_id TEXT NOT NULL, file_id TEXT NOT NULL,
    text TEXT NOT NULL, embedding BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_store_file ON chunks (store_id, file_id);
"""


@dataclass
class FileRow:
    """An uploaded file; its bytes are in ``files/<id>`` under the data dir."""

    id: str
    filename: str
    bytes: int
    purpose: str
    created_at: int


@dataclass
class StoreRow:
    """A vector store."""

    id: str
    name: str
    description: str | None
    created_at: int
    last_active_at: int
    metadata: dict[str, str] | None
    expires_days: int | None


@dataclass
class StoreFileRow:
    """A file attached to a store: its ingestion status, attributes and chunking."""

    store_id: str
    file_id: str
    created_at: int
    status: str
    error_code: str | None
    error_message: str | None
    attributes: dict[str, Any] | None
    max_tokens: int
    overlap: int
    usage_bytes: int = 0
    batch_id: str | None = None


def _json(v: Any) -> str | None:
    return None if v is None else json.dumps(v)


def _unjson(s: str | None) -> Any:
    return None if s is None else json.loads(s)


class Catalog:
    """Rows of files, stores, attachments, batches and chunks in one SQLite file."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # WAL: a crash mid-write loses at most that transaction, never the file.
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        """Close the database."""
        self.db.close()

    def _page(self, table: str, id_col: str, where: str, params: tuple[Any, ...],
              q: ListQuery) -> list[sqlite3.Row | tuple[Any, ...]]:
        """Up to ``q.limit + 1`` rows of ``table`` in creation order, after / before a cursor."""
        clauses, args = [where], list(params)
        for cursor, forward in ((q.after, True), (q.before, False)):
            if cursor is None:
                continue
            row = self.db.execute(f"SELECT seq FROM {table} WHERE {where} AND {id_col} = ?",
                                  (*params, cursor)).fetchone()
            if row is None:
                name = "after" if forward else "before"
                raise bad_request(f"{name}: {cursor!r} is not an id in this list", name)
            later = forward == (q.order == "asc")
            clauses.append("seq > ?" if later else "seq < ?")
            args.append(row[0])
        direction = "ASC" if q.order == "asc" else "DESC"
        return self.db.execute(
            f"SELECT * FROM {table} WHERE {' AND '.join(clauses)} ORDER BY seq {direction} "
            "LIMIT ?", (*args, q.limit + 1)).fetchall()

    # --- files ---------------------------------------------------------------------------

    def add_file(self, f: FileRow) -> None:
        """Record an uploaded file."""
        self.db.execute("INSERT INTO files (id, filename, bytes, purpose, created_at) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (f.id, f.filename, f.bytes, f.purpose, f.created_at))

    def get_file(self, file_id: str) -> FileRow | None:
        """The file, or None."""
        r = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return FileRow(*r[1:]) if r else None

    def list_files(self, q: ListQuery, purpose: str | None) -> list[FileRow]:
        """A page of files (one extra row says there is more)."""
        where, params = ("purpose = ?", (purpose,)) if purpose else ("1", ())
        return [FileRow(*r[1:]) for r in self._page("files", "id", where, params, q)]

    def delete_file(self, file_id: str) -> list[str]:
        """Forget a file, its attachments and chunks; the stores it was in."""
        stores = [r[0] for r in self.db.execute(
            "SELECT store_id FROM store_files WHERE file_id = ?", (file_id,))]
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM chunks WHERE file_id = ?", (file_id,))
            self.db.execute("DELETE FROM store_files WHERE file_id = ?", (file_id,))
            self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        return stores

    # --- stores --------------------------------------------------------------------------

    def add_store(self, s: StoreRow) -> None:
        """Record a new vector store."""
        self.db.execute("INSERT INTO stores (id, name, description, created_at, last_active_at,"
                        " metadata, expires_days) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (s.id, s.name, s.description, s.created_at, s.last_active_at,
                         _json(s.metadata), s.expires_days))

    @staticmethod
    def _store(r: tuple[Any, ...]) -> StoreRow:
        return StoreRow(r[1], r[2], r[3], r[4], r[5], _unjson(r[6]), r[7])

    def get_store(self, store_id: str) -> StoreRow | None:
        """The store, or None."""
        r = self.db.execute("SELECT * FROM stores WHERE id = ?", (store_id,)).fetchone()
        return self._store(r) if r else None

    def list_stores(self, q: ListQuery) -> list[StoreRow]:
        """A page of stores (one extra row says there is more)."""
        return [self._store(r) for r in self._page("stores", "id", "1", (), q)]

    def update_store(self, s: StoreRow) -> None:
        """Write back a store's name, metadata, expiry and activity time."""
        self.db.execute("UPDATE stores SET name = ?, metadata = ?, expires_days = ?, "
                        "last_active_at = ? WHERE id = ?",
                        (s.name, _json(s.metadata), s.expires_days, s.last_active_at, s.id))

    def touch_store(self, store_id: str, when: int) -> None:
        """Mark a store active (searches do), for its expiry."""
        self.db.execute("UPDATE stores SET last_active_at = ? WHERE id = ?", (when, store_id))

    def delete_store(self, store_id: str) -> None:
        """Forget a store, its attachments, batches and chunks (the files stay)."""
        with self.db:
            self.db.execute("BEGIN")
            for table, col in (("chunks", "store_id"), ("store_files", "store_id"),
                               ("batches", "store_id"), ("stores", "id")):
                self.db.execute(f"DELETE FROM {table} WHERE {col} = ?", (store_id,))

    def store_stats(self, store_id: str, batch_id: str | None = None) -> dict[str, int]:
        """Files per status and the bytes used, of a store or one of its batches."""
        where, params = ("store_id = ?", (store_id,))
        if batch_id is not None:
            where, params = where + " AND batch_id = ?", (store_id, batch_id)
        stats = {"in_progress": 0, "completed": 0, "failed": 0, "cancelled": 0,
                 "usage_bytes": 0}
        for status, n, used in self.db.execute(
                f"SELECT status, count(*), sum(usage_bytes) FROM store_files WHERE {where} "
                "GROUP BY status", params):
            stats[status] = n
            stats["usage_bytes"] += used or 0
        return stats

    # --- files in stores -----------------------------------------------------------------

    def add_store_file(self, f: StoreFileRow) -> None:
        """Attach a file to a store (status in_progress)."""
        self.db.execute(
            "INSERT INTO store_files (store_id, file_id, created_at, status, attributes, "
            "max_tokens, overlap, batch_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (f.store_id, f.file_id, f.created_at, f.status, _json(f.attributes), f.max_tokens,
             f.overlap, f.batch_id))

    @staticmethod
    def _store_file(r: tuple[Any, ...]) -> StoreFileRow:
        return StoreFileRow(r[1], r[2], r[3], r[4], r[5], r[6], _unjson(r[7]), r[8], r[9],
                            r[10], r[11])

    def get_store_file(self, store_id: str, file_id: str) -> StoreFileRow | None:
        """The attachment, or None."""
        r = self.db.execute("SELECT * FROM store_files WHERE store_id = ? AND file_id = ?",
                            (store_id, file_id)).fetchone()
        return self._store_file(r) if r else None

    def list_store_files(self, store_id: str, q: ListQuery, status: str | None = None,
                         batch_id: str | None = None) -> list[StoreFileRow]:
        """A page of a store's (or batch's) files, optionally of one status."""
        where, params = "store_id = ?", [store_id]
        if status is not None:
            where, params = where + " AND status = ?", params + [status]
        if batch_id is not None:
            where, params = where + " AND batch_id = ?", params + [batch_id]
        return [self._store_file(r) for r in self._page(
            "store_files", "file_id", where, tuple(params), q)]

    def store_files(self, store_id: str, status: str | None = None) -> list[StoreFileRow]:
        """Every file of a store (or of every store when ``store_id`` is ``*``)."""
        sql, params = "SELECT * FROM store_files WHERE 1", []
        if store_id != "*":
            sql, params = sql + " AND store_id = ?", [store_id]
        if status is not None:
            sql, params = sql + " AND status = ?", params + [status]
        return [self._store_file(r) for r in self.db.execute(sql + " ORDER BY seq", params)]

    def set_attributes(self, store_id: str, file_id: str, attrs: dict[str, Any] | None) -> None:
        """Replace an attachment's attributes."""
        self.db.execute("UPDATE store_files SET attributes = ? WHERE store_id = ? AND "
                        "file_id = ?", (_json(attrs), store_id, file_id))

    def finish_store_file(self, store_id: str, file_id: str, status: str,
                          error: tuple[str, str] | None = None, usage_bytes: int = 0) -> None:
        """Record how an attachment's ingestion ended."""
        code, message = error or (None, None)
        self.db.execute("UPDATE store_files SET status = ?, error_code = ?, error_message = ?, "
                        "usage_bytes = ? WHERE store_id = ? AND file_id = ?",
                        (status, code, message, usage_bytes, store_id, file_id))

    def delete_store_file(self, store_id: str, file_id: str) -> None:
        """Detach a file from a store and drop its chunks there."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM chunks WHERE store_id = ? AND file_id = ?",
                            (store_id, file_id))
            self.db.execute("DELETE FROM store_files WHERE store_id = ? AND file_id = ?",
                            (store_id, file_id))

    # --- batches -------------------------------------------------------------------------

    def add_batch(self, batch_id: str, store_id: str, created_at: int) -> None:
        """Record a file batch."""
        self.db.execute("INSERT INTO batches (id, store_id, created_at) VALUES (?, ?, ?)",
                        (batch_id, store_id, created_at))

    def get_batch(self, batch_id: str) -> tuple[str, int, bool] | None:
        """(store id, created_at, cancelled) of a batch, or None."""
        r = self.db.execute("SELECT store_id, created_at, cancelled FROM batches WHERE id = ?",
                            (batch_id,)).fetchone()
        return (r[0], r[1], bool(r[2])) if r else None

    def cancel_batch(self, batch_id: str) -> None:
        """Mark a batch cancelled and its files still in progress cancelled."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("UPDATE batches SET cancelled = 1 WHERE id = ?", (batch_id,))
            self.db.execute("UPDATE store_files SET status = 'cancelled' WHERE batch_id = ? "
                            "AND status = 'in_progress'", (batch_id,))

    # --- chunks --------------------------------------------------------------------------

    def add_chunks(self, store_id: str, file_id: str, texts: list[str],
                   vectors: np.ndarray, usage_bytes: int) -> list[int] | None:
        """Store a file's chunks and mark it completed, in one transaction; None (and nothing
        stored) if the file is no longer in progress in that store (detached meanwhile)."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            row = self.get_store_file(store_id, file_id)
            if row is None or row.status != "in_progress":
                return None
            ids = []
            for text, vec in zip(texts, vectors, strict=True):
                cur = self.db.execute("INSERT INTO chunks (store_id, file_id, text, embedding) "
                                      "VALUES (?, ?, ?, ?)",
                                      (store_id, file_id, text, vec.astype(np.float32).tobytes()))
                ids.append(int(cur.lastrowid or 0))
            self.finish_store_file(store_id, file_id, "completed", None, usage_bytes)
        return ids

    def chunk_texts(self, ids: list[int]) -> dict[int, tuple[str, str]]:
        """(file id, text) of each chunk id."""
        out: dict[int, tuple[str, str]] = {}
        for start in range(0, len(ids), 500):  # under SQLite's bound-parameter limit
            part = ids[start:start + 500]
            marks = ",".join("?" * len(part))
            for cid, fid, text in self.db.execute(
                    f"SELECT id, file_id, text FROM chunks WHERE id IN ({marks})", part):
                out[cid] = (fid, text)
        return out

    def file_chunks(self, store_id: str, file_id: str) -> list[str]:
        """A file's chunk texts in a store, in order."""
        return [r[0] for r in self.db.execute(
            "SELECT text FROM chunks WHERE store_id = ? AND file_id = ? ORDER BY id",
            (store_id, file_id))]

    def store_vectors(self, store_id: str) -> tuple[np.ndarray, list[str], np.ndarray]:
        """Chunk ids, their file ids and embeddings (rows) of a store, for its index."""
        ids: list[int] = []
        files: list[str] = []
        blobs: list[bytes] = []
        for cid, fid, blob in self.db.execute(
                "SELECT id, file_id, embedding FROM chunks WHERE store_id = ? ORDER BY id",
                (store_id,)):
            ids.append(cid)
            files.append(fid)
            blobs.append(blob)
        dim = len(blobs[0]) // 4 if blobs else 0
        vecs = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), dim)
        return np.array(ids, dtype=np.int64), files, vecs
