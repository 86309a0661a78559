"""The tenancy store: projects, their hashed API keys, limits, usage and the audit log, in one
SQLite database (WAL, so a killed server leaves every committed row and no torn one).

Pure Python over ``sqlite3``; one connection shared by the server's threads behind a lock
(each call is one short transaction)."""

from __future__ import annotations

import calendar
import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

from tokenmill.api.organization import LIMIT_FIELDS
from tokenmill.tenancy.keys import key_hash, new_key, redacted

DB_NAME = "tenancy.sqlite"
# How stale a key's last_used_at may be (seconds).
LAST_USED_RESOLUTION_S = 60
# Usage rows deleted per transaction when pruning (--usage-retention-days).
PRUNE_BATCH = 5000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, created_at INTEGER NOT NULL,
    archived_at INTEGER, priority INTEGER NOT NULL DEFAULT 0,
    max_requests_per_1_minute INTEGER, max_tokens_per_1_minute INTEGER,
    max_concurrent_requests INTEGER, monthly_budget REAL);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, project_id TEXT NOT NULL REFERENCES projects(id), name TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE, redacted_value TEXT NOT NULL, created_at INTEGER NOT NULL,
    last_used_at INTEGER, deleted_at INTEGER);
CREATE INDEX IF NOT EXISTS api_keys_project ON api_keys(project_id);
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, project_id TEXT, key_id TEXT,
    model TEXT NOT NULL, kind TEXT NOT NULL, input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL, cost REAL NOT NULL, finish_reason TEXT,
    latency REAL NOT NULL);
CREATE INDEX IF NOT EXISTS usage_time ON usage(project_id, time);
CREATE INDEX IF NOT EXISTS usage_by_time ON usage(time);
CREATE TABLE IF NOT EXISTS owners (
    object_id TEXT PRIMARY KEY, project_id TEXT NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS audit_log (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time INTEGER NOT NULL, type TEXT NOT NULL,
    project_id TEXT, actor TEXT NOT NULL, details TEXT NOT NULL);
"""



@dataclass(frozen=True)
class Project:
    """One tenant. ``priority``: its requests' scheduling class (lower runs first, as vLLM's
    priority policy reads it); the limits: None where it has none."""

    id: str
    name: str
    created_at: int
    archived_at: int | None = None
    priority: int = 0
    max_requests_per_1_minute: int | None = None
    max_tokens_per_1_minute: int | None = None
    max_concurrent_requests: int | None = None
    monthly_budget: float | None = None

    @property
    def active(self) -> bool:
        return self.archived_at is None


@dataclass(frozen=True)
class ApiKey:
    """One project key as listings show it (never its value)."""

    id: str
    project_id: str
    name: str
    redacted_value: str
    created_at: int
    last_used_at: int | None = None


@dataclass(frozen=True)
class Caller:
    """Who a request's key says made it."""

    project: Project
    key_id: str


class NotFound(LookupError):
    """No such project or key (or one of another project: the same answer)."""


def _row(cls: type, row: sqlite3.Row) -> Any:
    return cls(**{f.name: row[f.name] for f in fields(cls)})


class TenancyStore:
    """Projects, keys, usage and audit records in ``<data_dir>/tenancy.sqlite``."""

    def __init__(self, data_dir: str) -> None:
        os.makedirs(data_dir, exist_ok=True)
        self.path = os.path.join(data_dir, DB_NAME)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        # WAL: readers never wait for the writer, and a commit is one append to the log, so a
        # SIGKILL leaves the database at its last commit. NORMAL is durable against a process
        # crash (only a power loss can drop the last commits).
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        with self._lock:
            self._db.executescript(_SCHEMA)
        self.audit_dir = os.path.join(data_dir, "audit")
        self.rotate_audit()

    def close(self) -> None:
        """Close the database (further calls fail)."""
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, statements: list[tuple[str, tuple]]) -> None:
        """Run ``statements`` as one transaction: all of them or none."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # Projects.

    def create_project(self, name: str, actor: str, priority: int = 0,
                       limits: dict[str, float | None] | None = None) -> Project:
        """A new active project (its id: ``proj_`` and 24 random characters)."""
        limits = limits or {}
        project = Project(id="proj_" + secrets.token_hex(12), name=name,
                          created_at=int(time.time()), priority=priority,
                          **{k: limits.get(k) for k in LIMIT_FIELDS})
        cols = [f.name for f in fields(Project)]
        self._write([
            (f"INSERT INTO projects ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
             tuple(getattr(project, c) for c in cols)),
            self._audit_sql("project.created", project.id, actor,
                            {"name": name, "priority": priority, **limits})])
        return project

    def project(self, project_id: str) -> Project:
        """The project ``project_id`` (NotFound if none)."""
        rows = self._exec("SELECT * FROM projects WHERE id = ?", (project_id,))
        if not rows:
            raise NotFound(project_id)
        return _row(Project, rows[0])

    def projects(self, include_archived: bool = False) -> list[Project]:
        """Every project, oldest first."""
        where = "" if include_archived else "WHERE archived_at IS NULL"
        rows = self._exec(f"SELECT * FROM projects {where} ORDER BY created_at, rowid")
        return [_row(Project, r) for r in rows]

    def update_project(self, project_id: str, actor: str, changes: dict[str, Any]) -> Project:
        """Set the name, priority or limits in ``changes`` (keys of Project) of an active
        project; the audit log records the change."""
        project = self.project(project_id)
        if not project.active:
            raise ValueError(f"the project {project_id!r} is archived; it cannot be modified")
        allowed = {"name", "priority", *LIMIT_FIELDS}
        changes = {k: v for k, v in changes.items() if k in allowed}
        if not changes:
            return project
        sets = ", ".join(f"{k} = ?" for k in changes)
        kind = ("project.limits_updated" if set(changes) - {"name"} else "project.updated")
        self._write([(f"UPDATE projects SET {sets} WHERE id = ?",
                      (*changes.values(), project_id)),
                     self._audit_sql(kind, project_id, actor, changes)])
        return self.project(project_id)

    def archive_project(self, project_id: str, actor: str) -> Project:
        """Archive a project: its keys stop working at once; its records stay."""
        project = self.project(project_id)
        if project.active:
            self._write([("UPDATE projects SET archived_at = ? WHERE id = ?",
                          (int(time.time()), project_id)),
                         self._audit_sql("project.archived", project_id, actor, {})])
        return self.project(project_id)

    # Keys.

    def create_key(self, project_id: str, name: str, actor: str) -> tuple[ApiKey, str]:
        """A new key of an active project: its listing and its value (shown this once)."""
        project = self.project(project_id)
        if not project.active:
            raise ValueError(f"the project {project_id!r} is archived; it takes no new keys")
        value = new_key()
        key = ApiKey(id="key_" + secrets.token_hex(12), project_id=project_id, name=name,
                     redacted_value=redacted(value), created_at=int(time.time()))
        self._write([
            ("INSERT INTO api_keys (id, project_id, name, hash, redacted_value, created_at) "
             "VALUES (?, ?, ?, ?, ?, ?)", (key.id, project_id, name, key_hash(value),
                                           key.redacted_value, key.created_at)),
            self._audit_sql("api_key.created", project_id, actor,
                            {"id": key.id, "name": name})])
        return key, value

    def keys(self, project_id: str) -> list[ApiKey]:
        """The live keys of a project, oldest first (NotFound for no such project)."""
        self.project(project_id)
        rows = self._exec("SELECT * FROM api_keys WHERE project_id = ? AND deleted_at IS NULL "
                          "ORDER BY created_at, rowid", (project_id,))
        return [_row(ApiKey, r) for r in rows]

    def key(self, project_id: str, key_id: str) -> ApiKey:
        """One live key of the project (NotFound otherwise)."""
        rows = self._exec("SELECT * FROM api_keys WHERE id = ? AND project_id = ? AND "
                          "deleted_at IS NULL", (key_id, project_id))
        if not rows:
            raise NotFound(key_id)
        return _row(ApiKey, rows[0])

    def revoke_key(self, project_id: str, key_id: str, actor: str) -> None:
        """Revoke a key: the next request that bears it gets 401."""
        self.key(project_id, key_id)
        self._write([("UPDATE api_keys SET deleted_at = ? WHERE id = ?",
                      (int(time.time()), key_id)),
                     self._audit_sql("api_key.deleted", project_id, actor, {"id": key_id})])

    def caller(self, value: str) -> Caller | None:
        """The project and key id of a key's value; None for an unknown or revoked key or an
        archived project (the caller is not told which)."""
        rows = self._exec(
            "SELECT k.id AS key_id, k.last_used_at AS key_used, p.* FROM api_keys k "
            "JOIN projects p ON p.id = k.project_id "
            "WHERE k.hash = ? AND k.deleted_at IS NULL AND p.archived_at IS NULL",
            (key_hash(value),))
        if not rows:
            return None
        now = int(time.time())
        # last_used_at to the minute: one write per key and minute, not one per request.
        if rows[0]["key_used"] is None or rows[0]["key_used"] <= now - LAST_USED_RESOLUTION_S:
            self._write([("UPDATE api_keys SET last_used_at = ? WHERE id = ?",
                          (now, rows[0]["key_id"]))])
        return Caller(_row(Project, rows[0]), rows[0]["key_id"])

    # Objects (files, vector stores, stored responses) and the project that made them.

    def set_owner(self, object_id: str, project_id: str) -> None:
        """Record that ``project_id`` made ``object_id`` (the first record stands)."""
        self._write([("INSERT OR IGNORE INTO owners (object_id, project_id, created_at) "
                      "VALUES (?, ?, ?)", (object_id, project_id, int(time.time())))])

    def owned(self, object_ids: list[str], project_id: str | None) -> set[str]:
        """Which of ``object_ids`` the project made; with None, which no project made (the
        server key's, or a keyless request's: OpenAI's "Default project")."""
        if not object_ids:
            return set()
        marks = ", ".join("?" * len(object_ids))
        if project_id is None:
            rows = self._exec(f"SELECT object_id FROM owners WHERE object_id IN ({marks})",
                              tuple(object_ids))
            return set(object_ids) - {r["object_id"] for r in rows}
        rows = self._exec(f"SELECT object_id FROM owners WHERE project_id = ? AND object_id "
                          f"IN ({marks})", (project_id, *object_ids))
        return {r["object_id"] for r in rows}

    # Usage and audit.

    def record_usage(self, record: dict[str, Any], content: dict[str, Any] | None = None
                     ) -> None:
        """One finished request's usage row and its ``request.completed`` audit record
        (with ``content``, the prompt and answer text, when given), in one transaction."""
        cols = ("time", "project_id", "key_id", "model", "kind", "input_tokens",
                "output_tokens", "cost", "finish_reason", "latency")
        if record["time"] >= self._rotated_month + 31 * 86400 or (
                time.gmtime(record["time"]).tm_mon != time.gmtime(self._rotated_month).tm_mon):
            self.rotate_audit(record["time"])
        details = {c: record[c] for c in cols if c not in ("time", "project_id")}
        self._write([(f"INSERT INTO usage ({', '.join(cols)}) VALUES "
                      f"({', '.join('?' * len(cols))})", tuple(record[c] for c in cols)),
                     self._audit_sql("request.completed", record["project_id"],
                                     record["key_id"], {**details, **(content or {})})])

    def spent_since(self, project_id: str, since: float) -> float:
        """The project's cost since ``since`` (epoch seconds)."""
        rows = self._exec("SELECT COALESCE(SUM(cost), 0) AS s FROM usage WHERE project_id = ? "
                          "AND time >= ?", (project_id, since))
        return float(rows[0]["s"])

    def prune_usage(self, before: float, batch: int = PRUNE_BATCH) -> int:
        """Delete the usage rows older than ``before`` (epoch seconds), ``batch`` rows per
        transaction so that no request waits long for the write lock; how many went."""
        deleted = 0
        while True:
            with self._lock:
                n = self._db.execute(
                    "DELETE FROM usage WHERE id IN (SELECT id FROM usage WHERE time < ? "
                    "LIMIT ?)", (before, batch)).rowcount
            deleted += n
            if n < batch:
                return deleted

    def usage_rows(self, start: float, end: float | None = None) -> list[dict[str, Any]]:
        """The usage rows in [start, end), oldest first."""
        end = time.time() + 1 if end is None else end
        rows = self._exec("SELECT * FROM usage WHERE time >= ? AND time < ? ORDER BY time",
                          (start, end))
        return [dict(r) for r in rows]

    def audit(self, kind: str, project_id: str | None, actor: str,
              details: dict[str, Any]) -> None:
        """Append one audit record."""
        self._write([self._audit_sql(kind, project_id, actor, details)])

    def audit_rows(self, *, before_id: int | None = None, limit: int = 100,
                   types: tuple[str, ...] = (), project_ids: tuple[str, ...] = (),
                   since: float = 0, until: float = float("inf")) -> list[dict[str, Any]]:
        """Audit records, newest first: those older than ``before_id`` (when set), of the
        ``types`` and ``project_ids`` (when given), with ``since <= time < until``."""
        where, args = ["time >= ?", "time < ?"], [since, min(until, 1 << 62)]
        if before_id is not None:
            where.append("id < ?")
            args.append(before_id)
        for column, values in (("type", types), ("project_id", project_ids)):
            if values:
                where.append(f"{column} IN ({', '.join('?' * len(values))})")
                args += values
        rows = self._exec(f"SELECT * FROM audit_log WHERE {' AND '.join(where)} "
                          "ORDER BY id DESC LIMIT ?", (*args, limit))
        return [{**dict(r), "details": json.loads(r["details"])} for r in rows]

    def rotate_audit(self, now: float | None = None) -> list[str]:
        """Move the audit records of past months (UTC) out of the database into one JSONL
        file per month, ``audit/audit-YYYY-MM-<first id>-<last id>.jsonl``, written whole and
        renamed into place before the records leave the database (a crash in between
        rewrites the same file next time). The files written."""
        now = time.time() if now is None else now
        t = time.gmtime(now)
        month_start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
        rows = self._exec("SELECT * FROM audit_log WHERE time < ? ORDER BY id", (month_start,))
        by_month: dict[str, list[sqlite3.Row]] = {}
        for r in rows:
            by_month.setdefault(time.strftime("%Y-%m", time.gmtime(r["time"])), []).append(r)
        written = []
        for month, records in by_month.items():
            os.makedirs(self.audit_dir, exist_ok=True)
            name = os.path.join(self.audit_dir, f"audit-{month}-{records[0]['id']}-"
                                f"{records[-1]['id']}.jsonl")
            with open(name + ".tmp", "w", encoding="utf-8") as f:
                for r in records:
                    f.write(json.dumps({**dict(r), "details": json.loads(r["details"])}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(name + ".tmp", name)
            ids = [r["id"] for r in records]
            self._write([(f"DELETE FROM audit_log WHERE id IN ({', '.join('?' * len(ids))})",
                          tuple(ids))])
            written.append(name)
        self._rotated_month = month_start
        return written

    @staticmethod
    def _audit_sql(kind: str, project_id: str | None, actor: str,
                   details: dict[str, Any]) -> tuple[str, tuple]:
        return ("INSERT INTO audit_log (time, type, project_id, actor, details) "
                "VALUES (?, ?, ?, ?, ?)",
                (int(time.time()), kind, project_id, actor, json.dumps(details)))
