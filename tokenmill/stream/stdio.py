"""JSONL records from a byte stream (stdin), results as JSONL lines to a text stream (stdout)."""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import IO

from tokenmill.stream.records import Record

_EOF = object()


class LineSource:
    """Reads JSON-object lines on a background thread, so the engine never waits on input.

    The hand-over queue is bounded: when the job is at its in-flight limit and the queue is
    full, the reader stops reading and the writer on the other end of the pipe blocks
    (backpressure). Acknowledging is a no-op: a pipe cannot be replayed.
    """

    def __init__(self, stream: IO[bytes], buffer: int) -> None:
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, buffer))
        self.exhausted = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True,
                                        name="tokenmill-stream-stdin")
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        for number, raw in enumerate(stream, start=1):
            if raw.strip():
                self._queue.put((number, raw))
        self._queue.put(_EOF)

    def read(self, max_records: int, timeout: float) -> list[Record]:
        """Up to ``max_records`` records, waiting at most ``timeout`` seconds for the first."""
        out: list[Record] = []
        while len(out) < max_records and not self.exhausted:
            try:
                item = self._queue.get(timeout=timeout) if not out and timeout > 0 \
                    else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _EOF:
                self.exhausted = True
                break
            number, raw = item  # type: ignore[misc]
            out.append(parse_record(str(number), raw))
        return out

    def ack(self, records: list[Record]) -> None:
        """Nothing to do: the result is written, and a pipe has no redelivery."""


def parse_record(record_id: str, raw: bytes) -> Record:
    """A JSON-object line as a Record; anything else as a Record carrying its error."""
    now = time.monotonic()
    try:
        fields = json.loads(raw)
    except ValueError as e:  # also bad UTF-8
        return Record(record_id, None, now, error=f"line {record_id}: not valid JSON: {e}")
    if not isinstance(fields, dict):
        return Record(record_id, None, now, error=f"line {record_id}: must be a JSON object, "
                                                   f"got {type(fields).__name__}")
    return Record(record_id, fields, now)


class LineSink:
    """Writes each result as one JSON line and flushes, before its record is acknowledged."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, results: list[tuple[Record, str]]) -> None:
        for _, line in results:
            self._stream.write(line + "\n")
        self._stream.flush()
