"""Records from a Redis Stream through a consumer group; results to another Redis Stream.

Delivery is at-least-once: an entry is acknowledged (XACK) only after its result has been
written, so a consumer that dies leaves its unanswered entries in the group's pending entries
list (PEL). They are recovered two ways: a consumer restarted under the same name first
re-reads its own PEL (XREADGROUP from id 0), and every consumer periodically takes over
entries that another consumer has left pending for ``claim_idle_ms`` (XAUTOCLAIM).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tokenmill.stream.records import Record

logger = logging.getLogger(__name__)


def connect(url: str) -> Any:
    """A client for ``url`` (redis://host:port/db); ValueError when redis-py is missing or the
    server cannot be reached."""
    try:
        import redis
    except ImportError:
        raise ValueError("Redis streams need the redis client: pip install redis") from None
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        client.ping()
    except redis.RedisError as e:
        raise ValueError(f"cannot reach Redis at {url}: {e}") from None
    return client


class RedisSource:
    """Reads entries of ``stream`` as consumer ``consumer`` of group ``group``.

    The group is created if missing, reading from ``start_id`` ("0": the whole stream, "$":
    only entries added from now on).
    """

    def __init__(self, client: Any, stream: str, group: str, consumer: str, *,
                 start_id: str = "0", claim_idle_ms: int = 30_000) -> None:
        import redis

        if claim_idle_ms < 0:
            raise ValueError(f"claim_idle_ms must be >= 0, got {claim_idle_ms}")
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.claim_idle_ms = claim_idle_ms
        self.exhausted = False  # a stream never ends
        try:
            client.xgroup_create(stream, group, id=start_id, mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._own_pel_cursor: str | None = "0"  # None once our own PEL has been re-read
        self._claim_cursor = "0-0"
        self._next_claim = 0.0  # monotonic time of the next XAUTOCLAIM pass
        # Entries this process holds unanswered: a claim pass must not hand them out again.
        self._held: set[str] = set()

    def read(self, max_records: int, timeout: float) -> list[Record]:
        """Up to ``max_records`` entries: our own pending ones first, then entries claimed from
        dead consumers, then new ones (waiting up to ``timeout`` s when there are none)."""
        if self._own_pel_cursor is not None:
            entries = self._read_group(self._own_pel_cursor, max_records, None)
            if entries:
                self._own_pel_cursor = entries[-1][0]
                return self._records(entries)
            self._own_pel_cursor = None
        if time.monotonic() >= self._next_claim:
            claimed = self._claim(max_records)
            if claimed:
                return claimed
        block = int(timeout * 1000) if timeout > 0 else None  # BLOCK 0 would wait forever
        return self._records(self._read_group(">", max_records, block))

    def _read_group(self, from_id: str, count: int, block: int | None) -> list[tuple[str, Any]]:
        reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: from_id},
                                       count=count, block=block)
        return reply[0][1] if reply else []

    def _claim(self, count: int) -> list[Record]:
        """One XAUTOCLAIM page; once the whole PEL is scanned, wait before the next pass."""
        cursor, entries, *deleted = self.client.xautoclaim(
            self.stream, self.group, self.consumer, self.claim_idle_ms,
            start_id=self._claim_cursor, count=count)
        if deleted and deleted[0]:  # entries deleted from the stream while pending
            self.client.xack(self.stream, self.group, *deleted[0])
        self._claim_cursor = cursor
        if cursor == "0-0":
            self._next_claim = time.monotonic() + max(self.claim_idle_ms / 2000, 0.1)
        fresh = [(eid, fields) for eid, fields in entries if eid not in self._held]
        if fresh:
            logger.info("claimed %d pending entries of %s from idle consumers",
                        len(fresh), self.stream)
        return self._records(fresh)

    def _records(self, entries: list[tuple[str, Any]]) -> list[Record]:
        now, wall = time.monotonic(), time.time()
        out = []
        for entry_id, fields in entries:
            if not fields:  # deleted from the stream while pending (an entry has >= 1 field)
                self.client.xack(self.stream, self.group, entry_id)
                continue
            self._held.add(entry_id)
            added_ms = int(entry_id.split("-", 1)[0])
            out.append(Record(entry_id, dict(fields), now,
                              source_wait_s=max(0.0, wall - added_ms / 1000)))
        return out

    def ack(self, records: list[Record]) -> None:
        """XACK: the results of these entries are written."""
        ids = [r.id for r in records]
        if ids:
            self.client.xack(self.stream, self.group, *ids)
            self._held.difference_update(ids)


class RedisSink:
    """Appends each result to ``stream``: an entry ``{"id": <input entry id>, "result": JSON}``."""

    def __init__(self, client: Any, stream: str) -> None:
        self.client, self.stream = client, stream

    def write(self, results: list[tuple[Record, str]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for record, line in results:
            pipe.xadd(self.stream, {"id": record.id, "result": line})
        pipe.execute()

