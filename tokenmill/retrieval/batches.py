"""OpenAI's Batch API over the server: batch objects kept in ``<data dir>/batches.sqlite``, and
the run of one batch: its input file's lines (read with the batch format's own parser) sent
one by one, a few at a time, to the server's own endpoint by ``call``, the answers written to
an output file and the failures to an error file, both stored as files (``batch_output``).

HTTP-free: the server gives ``call`` (an in-process request to itself, so a line gets the
answer, the checks, the usage accounting and the project scope the endpoint would give) and
``store_file`` (a new file from a path). The routes are tokenmill/server/batch_routes.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sqlite3
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.api.batch_format import (
    BatchOutput,
    BatchRequest,
    BatchResponse,
    LineError,
    error_line,
    output_id,
    parse_line,
)
from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.files import ListQuery
from tokenmill.api.protocol import now

logger = logging.getLogger(__name__)

# What a batch may ask for: the endpoints it can run, and OpenAI's only completion window.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOW_S = 24 * 3600
# Lines of one batch in the engine at once (the engine batches them; more only queue).
LINES_IN_FLIGHT = 8
MAX_BATCH_LINES = 50_000
TERMINAL = ("completed", "failed", "expired", "cancelled")

Call = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
StoreFile = Callable[[str, str], Awaitable[str]]


class BatchCreate(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)

    def checked(self) -> BatchCreate:
        """Itself; 400 naming the field for an endpoint or window the server does not run."""
        if self.endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got "
                              f"{self.endpoint[:100]!r}", "endpoint")
        if self.completion_window != "24h":
            raise bad_request(f"completion_window must be '24h', got "
                              f"{self.completion_window[:20]!r}", "completion_window")
        return self


def new_batch(req: BatchCreate) -> dict[str, Any]:
    """A new batch object, as OpenAI shows it (status ``validating``)."""
    created = now()
    return {"id": "batch_" + secrets.token_hex(12), "object": "batch",
            "endpoint": req.endpoint, "errors": None, "input_file_id": req.input_file_id,
            "completion_window": req.completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": created,
            "in_progress_at": None, "expires_at": created + COMPLETION_WINDOW_S,
            "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": req.metadata}


class BatchStore:
    """Batch objects by id, in creation order; a batch a restart interrupted is failed."""

    def __init__(self, data_dir: str) -> None:
        os.makedirs(data_dir, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(os.path.join(data_dir, "batches.sqlite"),
                                   check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS batches (seq INTEGER PRIMARY KEY "
                         "AUTOINCREMENT, id TEXT UNIQUE NOT NULL, body TEXT NOT NULL)")
        for batch in self._all_unfinished():
            self.save({**batch, "status": "failed", "failed_at": now(), "errors": {
                "object": "list", "data": [{"code": "server_restarted", "message":
                                            "the server stopped while the batch ran"}]}})

    def _all_unfinished(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT body FROM batches").fetchall()
        return [b for (body,) in rows if (b := json.loads(body))["status"] not in TERMINAL]

    def save(self, batch: dict[str, Any]) -> None:
        """Insert or replace the batch."""
        with self._lock:
            self._db.execute("INSERT INTO batches (id, body) VALUES (?, ?) ON CONFLICT (id) "
                             "DO UPDATE SET body = excluded.body", (batch["id"], json.dumps(batch)))

    def get(self, batch_id: str) -> dict[str, Any]:
        """The batch; 404 if there is none."""
        with self._lock:
            row = self._db.execute("SELECT body FROM batches WHERE id = ?",
                                   (batch_id,)).fetchone()
        if row is None:
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id",
                           code="not_found")
        return json.loads(row[0])

    def page(self, q: ListQuery) -> dict[str, Any]:
        """One page of batches, newest first unless ``q.order`` is ``asc``."""
        clauses, args = ["1"], []
        with self._lock:
            for cursor, forward in ((q.after, True), (q.before, False)):
                if cursor is None:
                    continue
                row = self._db.execute("SELECT seq FROM batches WHERE id = ?",
                                       (cursor,)).fetchone()
                name = "after" if forward else "before"
                if row is None:
                    raise bad_request(f"{name}: {cursor!r} is not an id in this list", name)
                clauses.append("seq > ?" if forward == (q.order == "asc") else "seq < ?")
                args.append(row[0])
            direction = "ASC" if q.order == "asc" else "DESC"
            rows = self._db.execute(f"SELECT body FROM batches WHERE {' AND '.join(clauses)} "
                                    f"ORDER BY seq {direction} LIMIT ?",
                                    (*args, q.limit + 1)).fetchall()
        data = [json.loads(body) for (body,) in rows[:q.limit]]
        return {"object": "list", "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > q.limit}


@dataclass
class _Outputs:
    """The output and error files being written, and the counts."""

    out: Any
    err: Any
    completed: int = 0
    failed: int = 0


def count_lines(path: str) -> int:
    """The input file's requests (non-blank lines); 400 beyond MAX_BATCH_LINES."""
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            n += bool(raw.strip())
            if n > MAX_BATCH_LINES:
                raise bad_request(f"a batch may hold at most {MAX_BATCH_LINES} requests",
                                  "input_file_id")
    return n


def read_lines(path: str, endpoint: str) -> Iterator[BatchRequest | LineError]:
    """The input file's lines, parsed one at a time; a line for another endpoint or a
    repeated custom_id is an error."""
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            item = parse_line(number, raw)
            if isinstance(item, BatchRequest):
                first = seen.setdefault(item.custom_id, number)
                if first != number:
                    item = LineError(number, item.custom_id, f"line {number}: custom_id "
                                     f"{item.custom_id!r} is already used on line {first}")
                elif item.url != endpoint:
                    item = LineError(number, item.custom_id, f"line {number}: url must be the "
                                     f"batch's endpoint {endpoint!r}, got {item.url!r}")
            yield item


class BatchRun:
    """One batch's run: ``cancel`` stops it between lines."""

    def __init__(self, store: BatchStore, batch: dict[str, Any], call: Call,
                 store_file: StoreFile) -> None:
        self.store = store
        self.batch = batch
        self._call = call
        self._store_file = store_file
        self.cancelled = False

    def _save(self, **changes: Any) -> None:
        self.batch = {**self.batch, **changes}
        self.store.save(self.batch)

    def cancel(self) -> dict[str, Any]:
        """Stop sending lines; the batch is ``cancelling`` until the lines in flight end."""
        if self.batch["status"] not in TERMINAL:
            self.cancelled = True
            self._save(status="cancelling", cancelling_at=now())
        return self.batch

    async def run(self, input_path: str) -> None:
        """Answer every line of the input file, then store the output and error files; a
        batch that cannot go on is ``failed`` with the reason."""
        try:
            await self._run(input_path)
        except APIError as e:
            self._fail("invalid_input_file", e.message)
        except Exception as e:
            logger.exception("batch %s failed", self.batch["id"])
            self._fail("internal_error", f"the batch stopped: {type(e).__name__}")

    def _fail(self, code: str, message: str) -> None:
        self._save(status="failed", failed_at=now(),
                   errors={"object": "list", "data": [{"code": code, "message": message}]})

    async def _run(self, input_path: str) -> None:
        total = await asyncio.to_thread(count_lines, input_path)
        if not self.cancelled:
            self._save(status="in_progress", in_progress_at=now(),
                       request_counts={"total": total, "completed": 0, "failed": 0})
        with tempfile.TemporaryDirectory() as folder:
            paths = (os.path.join(folder, "output.jsonl"), os.path.join(folder, "errors.jsonl"))
            with open(paths[0], "w", encoding="utf-8") as out, \
                    open(paths[1], "w", encoding="utf-8") as err:
                outputs = _Outputs(out, err)
                await self._answer(read_lines(input_path, self.batch["endpoint"]), outputs)
            await self._finish(outputs, paths)

    async def _answer(self, items: Iterator[BatchRequest | LineError], o: _Outputs) -> None:
        """LINES_IN_FLIGHT workers take the lines one by one (the file is read as they go)."""
        reading = asyncio.Lock()  # one generator: one reader at a time

        async def worker() -> None:
            while not self.cancelled:
                async with reading:
                    item = await asyncio.to_thread(next, items, None)
                if item is None:
                    return
                await self._one(item, o)

        await asyncio.gather(*(worker() for _ in range(LINES_IN_FLIGHT)))

    async def _one(self, item: BatchRequest | LineError, o: _Outputs) -> None:
        if isinstance(item, LineError):
            o.err.write(error_line(item) + "\n")
            o.failed += 1
        else:
            status, body = await self._call(item.url, item.body)
            # A refused request keeps the status and body the endpoint answered.
            line = BatchOutput(id=output_id(item.line), custom_id=item.custom_id,
                               response=BatchResponse(status_code=status, body=body))
            (o.out if status == 200 else o.err).write(line.model_dump_json() + "\n")
            if status == 200:
                o.completed += 1
            else:
                o.failed += 1
        self._save(request_counts={**self.batch["request_counts"],
                                   "completed": o.completed, "failed": o.failed})

    async def _finish(self, o: _Outputs, paths: tuple[str, str]) -> None:
        self._save(status="cancelling" if self.cancelled else "finalizing",
                   finalizing_at=None if self.cancelled else now())
        ids = []
        for path, kind, count in ((paths[0], "output", o.completed),
                                  (paths[1], "errors", o.failed)):
            ids.append(await self._store_file(path, f"{self.batch['id']}_{kind}.jsonl")
                       if count else None)
        done = {"status": "cancelled", "cancelled_at": now()} if self.cancelled else {
            "status": "completed", "completed_at": now()}
        self._save(output_file_id=ids[0], error_file_id=ids[1], **done)
