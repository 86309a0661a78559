"""The results file of a batch job: append-only, flushed per line, and readable after a kill.

Each answer is written as one line and flushed, so a killed job loses at most the line it was
writing. The next run with the same arguments reads what is there, cuts a torn last line, and
skips every input line already answered (matched by custom_id, or by the output ``id`` that
names the input line).
"""

from __future__ import annotations

import json
import logging
import os
from typing import IO

logger = logging.getLogger(__name__)


class ResultsFile:
    """What earlier runs answered, and an append handle for this run."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done_ids: set[str] = set()
        self.done_custom_ids: set[str] = set()
        if os.path.exists(path):
            self._load()
        self._file: IO[str] = open(path, "a", encoding="utf-8")

    def _load(self) -> None:
        with open(self.path, "rb+") as f:
            data = f.read()
            end = data.rfind(b"\n") + 1
            if end < len(data):  # a line cut short by a kill: drop it, its request runs again
                logger.warning("%s: dropping a torn last line (%d bytes) left by an earlier run",
                               self.path, len(data) - end)
                f.truncate(end)
        for number, raw in enumerate(data[:end].splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
                out_id, custom_id = obj["id"], obj.get("custom_id")
            except (ValueError, TypeError, KeyError):
                raise ValueError(
                    f"{self.path}, line {number}: not a batch output line; is the output path "
                    "right? (a resumed job appends to the results of earlier runs)") from None
            self.done_ids.add(out_id)
            if isinstance(custom_id, str):
                self.done_custom_ids.add(custom_id)

    def is_done(self, out_id: str, custom_id: str | None) -> bool:
        """Whether an earlier run answered this input line."""
        return out_id in self.done_ids or (custom_id is not None
                                           and custom_id in self.done_custom_ids)

    def append(self, line: str) -> None:
        """Write one answer and hand it to the OS at once (it survives the process's death)."""
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
