"""Per-project limits, kept in memory over a sliding minute: requests per minute, tokens per
minute (prompt and completion tokens, counted as the engine produces them), concurrent
requests; and the monthly budget, read from the store's usage rows."""

from __future__ import annotations

import calendar
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.tenancy.store import Project

WINDOW_S = 60.0


@dataclass
class _Window:
    """What one project did in the last minute, and what it runs now."""

    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    running: int = 0

    def trim(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: the message, and how long until it may succeed."""

    message: str
    retry_after_s: float
    code: str = "rate_limit_exceeded"


def month_start(now: float) -> float:
    """The epoch second at which ``now``'s calendar month (UTC) began."""
    t = time.gmtime(now)
    return float(calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)))


def seconds_to_next_month(now: float) -> float:
    t = time.gmtime(now)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0)) - now


class Limiter:
    """Admits or refuses a project's requests; ``spent(project_id, since)`` gives the cost
    recorded since a time (the store's usage)."""

    def __init__(self, spent: Callable[[str, float], float],
                 clock: Callable[[], float] = time.time) -> None:
        self._spent = spent
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    def _window(self, project_id: str) -> _Window:
        w = self._windows.get(project_id)
        if w is None:
            w = self._windows[project_id] = _Window()
        w.trim(self._clock())
        return w

    def admit(self, p: Project) -> Refusal | None:
        """Count a new request of ``p`` and hold a concurrency slot (``release`` frees it);
        or say why it is refused (nothing counted)."""
        refusal = self._budget_refusal(p)
        with self._lock:
            w, now = self._window(p.id), self._clock()
            if refusal is None:
                refusal = self._refusal(p, w, now)
            if refusal is None:
                w.requests.append(now)
                w.running += 1
        return refusal

    def _refusal(self, p: Project, w: _Window, now: float) -> Refusal | None:
        rpm, tpm = p.max_requests_per_1_minute, p.max_tokens_per_1_minute
        if rpm is not None and len(w.requests) >= rpm:
            return Refusal(f"the project's limit of {rpm} requests per minute is reached",
                           w.requests[0] + WINDOW_S - now)
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
    def _tokens_free_in(w: _Window, tpm: int, now: float) -> float:
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
            w = self._window(project_id)
            w.running = max(0, w.running - 1)

    def add_tokens(self, project_id: str, n: int) -> None:
        """Count ``n`` tokens the engine read or wrote for the project."""
        if n > 0:
            with self._lock:
                w = self._window(project_id)
                w.tokens.append((self._clock(), n))
                w.token_sum += n

    def headers(self, p: Project) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the project's per-minute limits."""
        with self._lock:
            w, now = self._window(p.id), self._clock()
            out: dict[str, str] = {}
            rpm, tpm = p.max_requests_per_1_minute, p.max_tokens_per_1_minute
            if rpm is not None:
                reset = w.requests[0] + WINDOW_S - now if w.requests else 0.0
                out |= {"x-ratelimit-limit-requests": str(rpm),
                        "x-ratelimit-remaining-requests": str(max(0, rpm - len(w.requests))),
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
