"""How long the usage table keeps its rows (``--usage-retention-days``), and the pruner that
deletes older ones: once when the server starts, then at most once per ``interval_s`` on a
thread of its own, started by a finished request (the table grows only with requests, so an
idle server has nothing to prune) and never awaited by one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.tenancy.limits import month_start
from tokenmill.tenancy.store import TenancyStore

logger = logging.getLogger(__name__)

# A year and a month: last year's same month stays comparable on the usage pages.
DEFAULT_USAGE_RETENTION_DAYS = 400
PRUNE_INTERVAL_S = 3600.0
DAY_S = 86400.0


@dataclass(frozen=True)
class TenancySettings:
    """The tenancy options of ``tokenmill serve``. ``usage_retention_days``: usage rows older
    than this are deleted (0: kept forever); the current calendar month's rows are always
    kept, since the monthly budgets read them."""

    usage_retention_days: float = DEFAULT_USAGE_RETENTION_DAYS

    def __post_init__(self) -> None:
        if not 0 <= self.usage_retention_days <= 100 * 365:
            raise ValueError("usage_retention_days must be in [0, 36500] (0: keep forever), "
                             f"got {self.usage_retention_days}")


class UsagePruner:
    """Deletes the usage rows older than the retention from ``store``."""

    def __init__(self, store: TenancyStore, retention_days: float,
                 interval_s: float = PRUNE_INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._retention_s = retention_days * DAY_S
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next = 0.0
        self._thread: threading.Thread | None = None

    def cutoff(self, now: float) -> float | None:
        """Rows before this epoch second go; None: none go (retention 0)."""
        if self._retention_s <= 0:
            return None
        return min(now - self._retention_s, month_start(now))

    def prune_now(self) -> int:
        """Delete the rows past the retention now; how many were deleted."""
        now = self._clock()
        with self._lock:
            self._next = now + self._interval_s
        cutoff = self.cutoff(now)
        if cutoff is None:
            return 0
        deleted = self._store.prune_usage(cutoff)
        if deleted:
            logger.info("deleted %d usage rows older than %s (--usage-retention-days)",
                        deleted, time.strftime("%Y-%m-%d", time.gmtime(cutoff)))
        return deleted

    def maybe_prune(self) -> threading.Thread | None:
        """Start pruning on a thread of its own if the interval has passed and none runs;
        that thread (None if none was started)."""
        if self._retention_s <= 0:
            return None
        with self._lock:
            if self._clock() < self._next or (self._thread is not None
                                               and self._thread.is_alive()):
                return None
            self._next = self._clock() + self._interval_s
            self._thread = threading.Thread(target=self._prune_logged, daemon=True,
                                            name="tokenmill-usage-pruner")
        self._thread.start()
        return self._thread

    def _prune_logged(self) -> None:
        try:
            self.prune_now()
        except Exception:  # a failed prune must not end the server; the next one retries
            logger.exception("pruning the usage table failed")
