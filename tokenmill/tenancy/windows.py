"""The per-minute windows and concurrency counts of the projects' limits, kept in the tenancy
store's SQLite file so that every server process over it (workers, replicas on one machine)
counts against the same limits.

A request is admitted in one ``BEGIN IMMEDIATE`` transaction: SQLite's write lock makes the
read of the window and the count of the new request one step, so N processes racing for the
last place of a limit admit one request, not N. Tokens, counted as the engine makes them, are
added up in the process and written in batches of at most ``FLUSH_S`` (and at each admission
and release), not one write per token; another process sees them that much later.

Concurrent requests are counted per process; a process that dies holding some (SIGKILL) stops
renewing its heartbeat, and after ``STALE_S`` its count no longer holds anyone back."""

from __future__ import annotations

import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

WINDOW_S = 60.0
# How often a process writes its pending tokens of a project (seconds).
FLUSH_S = 0.25
# A process that holds running requests renews its heartbeat this often (real seconds)...
HEARTBEAT_S = 5.0
# ... and one not seen for this long is taken for dead (its running requests no longer count).
STALE_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS limit_events (
    project_id TEXT NOT NULL, time REAL NOT NULL, requests INTEGER NOT NULL,
    tokens INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS limit_events_window ON limit_events(project_id, time);
CREATE TABLE IF NOT EXISTS limit_running (
    process_id TEXT NOT NULL, project_id TEXT NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (process_id, project_id));
CREATE TABLE IF NOT EXISTS limit_processes (process_id TEXT PRIMARY KEY, seen_at REAL NOT NULL);
"""

T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot:
    """A project's last minute over every process, and what it runs now."""

    requests: int
    first_request: float | None
    # (time, tokens) written in the window, oldest first.
    tokens: list[tuple[float, int]]
    running: int

    @property
    def token_sum(self) -> int:
        return sum(n for _, n in self.tokens)


class SharedWindows:
    """One process's handle on the shared windows of the store at ``path``."""

    def __init__(self, path: str, clock: Callable[[], float] = time.time,
                 process_id: str | None = None) -> None:
        self.process_id = process_id or "proc_" + secrets.token_hex(8)
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(_SCHEMA)
        self._forget_the_past()
        # Each project's tokens not yet written: (the time of the first, how many).
        self._pending: dict[str, tuple[float, int]] = {}
        self._held = 0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _forget_the_past(self) -> None:
        """Drop what no window reads any more: events of past minutes (a project's own are
        dropped at its admissions; these are of projects no longer used) and the counts of
        processes gone for a day."""
        now = self._clock()
        with self._lock:
            self._db.execute("DELETE FROM limit_events WHERE time <= ?", (now - WINDOW_S,))
            self._db.execute("DELETE FROM limit_running WHERE process_id IN (SELECT process_id "
                             "FROM limit_processes WHERE seen_at < ?)", (now - 86400,))
            self._db.execute("DELETE FROM limit_processes WHERE seen_at < ?", (now - 86400,))

    def close(self) -> None:
        """Stop the heartbeat and close the database (as a killed process would: no
        release; its running requests stop counting after STALE_S)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with self._lock:
            self._db.close()

    def _transaction(self, body: Callable[[float], T]) -> T:
        """``body(now)`` in one write transaction (other processes wait for it)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = body(self._clock())
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return out

    def admit(self, project_id: str, check: Callable[[Snapshot, float], T | None]) -> T | None:
        """Count a request of the project and a running one, unless ``check`` (given the
        window as every process left it) returns a refusal, which is returned."""
        def admit_in(now: float) -> T | None:
            self._flush_in(project_id)
            self._db.execute("DELETE FROM limit_events WHERE project_id = ? AND time <= ?",
                             (project_id, now - WINDOW_S))
            refusal = check(self._snapshot_in(project_id, now), now)
            if refusal is None:
                self._db.execute("INSERT INTO limit_events VALUES (?, ?, 1, 0)",
                                 (project_id, now))
                self._db.execute(
                    "INSERT INTO limit_running VALUES (?, ?, 1) ON CONFLICT "
                    "(process_id, project_id) DO UPDATE SET n = n + 1",
                    (self.process_id, project_id))
                self._seen_in(now)
                self._held += 1
            return refusal

        refusal = self._transaction(admit_in)
        if refusal is None:
            self._start_heartbeat()
        return refusal

    def release(self, project_id: str) -> None:
        """A request ``admit`` counted has ended."""
        def release_in(now: float) -> None:
            self._flush_in(project_id)
            self._db.execute("UPDATE limit_running SET n = MAX(0, n - 1) WHERE process_id = ? "
                             "AND project_id = ?", (self.process_id, project_id))
            self._seen_in(now)
            self._held = max(0, self._held - 1)

        self._transaction(release_in)

    def add_tokens(self, project_id: str, n: int) -> None:
        """Count ``n`` tokens of the project: kept with the tokens of the last FLUSH_S and
        written with them (stamped with the first one's time) by the next call after that,
        or by the next admission or release."""
        with self._lock:
            now = self._clock()
            since, pending = self._pending.get(project_id, (now, 0))
            if pending and now - since >= FLUSH_S:
                self._flush_in(project_id)
                since, pending = now, 0
            self._pending[project_id] = (since, pending + n)

    def snapshot(self, project_id: str) -> Snapshot:
        """The project's window now (this process's pending tokens included)."""
        with self._lock:
            now = self._clock()
            snap = self._snapshot_in(project_id, now)
            pending = self._pending.get(project_id)
        if pending is not None:
            snap = Snapshot(snap.requests, snap.first_request, [*snap.tokens, pending],
                            snap.running)
        return snap

    def _flush_in(self, project_id: str) -> None:
        """Write the project's pending tokens (the caller holds the lock)."""
        pending = self._pending.pop(project_id, None)
        if pending is not None and pending[1]:
            self._db.execute("INSERT INTO limit_events VALUES (?, ?, 0, ?)",
                             (project_id, *pending))

    def _snapshot_in(self, project_id: str, now: float) -> Snapshot:
        since = now - WINDOW_S
        count, first = self._db.execute(
            "SELECT COUNT(*), MIN(time) FROM limit_events WHERE project_id = ? AND time > ? "
            "AND requests > 0", (project_id, since)).fetchone()
        tokens = self._db.execute(
            "SELECT time, tokens FROM limit_events WHERE project_id = ? AND time > ? AND "
            "tokens > 0 ORDER BY time", (project_id, since)).fetchall()
        (running,) = self._db.execute(
            "SELECT COALESCE(SUM(r.n), 0) FROM limit_running r JOIN limit_processes p "
            "ON p.process_id = r.process_id WHERE r.project_id = ? AND p.seen_at > ?",
            (project_id, now - STALE_S)).fetchone()
        return Snapshot(count, first, [(t, n) for t, n in tokens], running)

    def _seen_in(self, now: float) -> None:
        self._db.execute("INSERT INTO limit_processes VALUES (?, ?) ON CONFLICT (process_id) "
                         "DO UPDATE SET seen_at = excluded.seen_at", (self.process_id, now))

    def _start_heartbeat(self) -> None:
        with self._lock:
            if self._beat is not None and self._beat.is_alive():
                return
            self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                          name="tokenmill-limits-heartbeat")
        self._beat.start()

    def _heartbeat(self) -> None:
        """Renew this process's heartbeat while it holds running requests."""
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                if self._held == 0:
                    self._beat = None
                    return
                self._seen_in(self._clock())
