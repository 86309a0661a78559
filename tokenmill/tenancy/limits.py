"""Per-project limits: requests per minute, tokens per minute (prompt and completion tokens,
counted as the engine produces them) and concurrent requests, counted in the tenancy store
for every server process over it (``windows``); and the monthly budget, read from the store's
usage rows. A project without per-minute or concurrency limits costs no write."""

from __future__ import annotations

import calendar
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.tenancy.store import Project, TenancyStore
from tokenmill.tenancy.windows import WINDOW_S, SharedWindows, Snapshot


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: the message, and how long until it may succeed."""

    message: str
    retry_after_s: float
    code: str = "rate_limit_exceeded"


def _counted(p: Project) -> bool:
    """Whether the project has a limit that needs its requests counted."""
    return (p.max_requests_per_1_minute is not None or p.max_tokens_per_1_minute is not None
            or p.max_concurrent_requests is not None)


def month_start(now: float) -> float:
    """The epoch second at which ``now``'s calendar month (UTC) began."""
    t = time.gmtime(now)
    return float(calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)))


def seconds_to_next_month(now: float) -> float:
    t = time.gmtime(now)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0)) - now


class Limiter:
    """Admits or refuses a project's requests, over the windows of ``store`` shared by every
    process that opens it."""

    def __init__(self, store: TenancyStore, clock: Callable[[], float] = time.time) -> None:
        self._spent = store.spent_since
        self._clock = clock
        self._windows = SharedWindows(store.path, clock)
        self._lock = threading.Lock()
        # This process's counted requests of each project (release uncounts only those), and
        # the projects whose tokens are counted (those with a tokens-per-minute limit).
        self._held: dict[str, int] = {}
        self._token_projects: set[str] = set()

    def close(self) -> None:
        """Stop counting (this process's running requests stop holding others back)."""
        self._windows.close()

    def admit(self, p: Project) -> Refusal | None:
        """Count a new request of ``p`` and hold a concurrency slot (``release`` frees it);
        or say why it is refused (nothing counted)."""
        refusal = self._budget_refusal(p)
        if refusal is not None or not _counted(p):
            return refusal
        self.follow(p)
        refusal = self._windows.admit(p.id, lambda snap, now: self._refusal(p, snap, now))
        if refusal is None:
            with self._lock:
                self._held[p.id] = self._held.get(p.id, 0) + 1
        return refusal

    def follow(self, p: Project) -> None:
        """Count the tokens of ``p``'s requests when it has a tokens-per-minute limit (also
        for a request that another process admitted: a Ray Serve replica behind the ingress)."""
        with self._lock:
            if p.max_tokens_per_1_minute is None:
                self._token_projects.discard(p.id)
            else:
                self._token_projects.add(p.id)

    def _refusal(self, p: Project, w: Snapshot, now: float) -> Refusal | None:
        rpm, tpm = p.max_requests_per_1_minute, p.max_tokens_per_1_minute
        if rpm is not None and w.requests >= rpm:
            first = w.first_request if w.first_request is not None else now
            return Refusal(f"the project's limit of {rpm} requests per minute is reached",
                           first + WINDOW_S - now)
        if tpm is not None and w.token_sum >= tpm:
            return Refusal(f"the project's limit of {tpm} tokens per minute is reached",
                           self._tokens_free_in(w, tpm, now))
        cap = p.max_concurrent_requests
        if cap is not None and w.running >= cap:
            return Refusal(f"the project's limit of {cap} concurrent requests is reached", 1.0)
        return None

    def _budget_refusal(self, p: Project) -> Refusal | None:
        if p.monthly_budget is None:
            return None
        now = self._clock()
        spent = self._spent(p.id, month_start(now))
        if spent < p.monthly_budget:
            return None
        return Refusal(f"the project's monthly budget of {p.monthly_budget:g} is spent "
                       f"({spent:.6g} this month)", seconds_to_next_month(now),
                       code="insufficient_quota")

    @staticmethod
    def _tokens_free_in(w: Snapshot, tpm: int, now: float) -> float:
        """Seconds until the minute's tokens fall below ``tpm``."""
        total = w.token_sum
        for t, n in w.tokens:
            total -= n
            if total < tpm:
                return t + WINDOW_S - now
        return WINDOW_S

    def release(self, project_id: str) -> None:
        """A request admitted by ``admit`` finished (or failed)."""
        with self._lock:
            held = self._held.get(project_id, 0)
            if held == 0:  # not counted (a project without limits when it was admitted)
                return
            self._held[project_id] = held - 1
        self._windows.release(project_id)

    def add_tokens(self, project_id: str, n: int) -> None:
        """Count ``n`` tokens the engine read or wrote for the project."""
        if n > 0 and project_id in self._token_projects:
            self._windows.add_tokens(project_id, n)

    def headers(self, p: Project) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the project's per-minute limits."""
        rpm, tpm = p.max_requests_per_1_minute, p.max_tokens_per_1_minute
        if rpm is None and tpm is None:
            return {}
        w, now = self._windows.snapshot(p.id), self._clock()
        out: dict[str, str] = {}
        if rpm is not None:
            reset = w.first_request + WINDOW_S - now if w.first_request is not None else 0.0
            out |= {"x-ratelimit-limit-requests": str(rpm),
                    "x-ratelimit-remaining-requests": str(max(0, rpm - w.requests)),
                    "x-ratelimit-reset-requests": duration(reset)}
        if tpm is not None:
            reset = self._tokens_free_in(w, tpm, now) if w.token_sum >= tpm else (
                w.tokens[0][0] + WINDOW_S - now if w.tokens else 0.0)
            out |= {"x-ratelimit-limit-tokens": str(tpm),
                    "x-ratelimit-remaining-tokens": str(max(0, tpm - w.token_sum)),
                    "x-ratelimit-reset-tokens": duration(reset)}
        return out


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``6m0s``, ``1.5s``, ``20ms``."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_s = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_s}s" if minutes else f"{rest_s}s"


def retry_after(seconds: float) -> str:
    """``Retry-After``'s whole seconds (at least 1)."""
    return str(max(1, math.ceil(seconds)))
