"""The drift monitor of one served model: a stat logger fed by the engine's finished sequences.

It keeps a reference window (the first N sequences, or a saved profile) and a sliding live
window of each sequence's signals (see ``signals``), and every ``score_every`` sequences scores
each signal's drift with the population stability index (``drift``). Scores go to a Prometheus
gauge; a score crossing the threshold, and one falling back, is logged as a warning.

``record`` runs on the engine thread: per finished sequence it reads a few fields and appends
to deques (the prompt's script costs a few regex passes over at most 2,000 characters), and
the scoring (a few numpy passes over the windows) runs once per ``score_every`` sequences,
never per token. The HTTP side reads under the same lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Protocol

from tokenmill.config import MonitorConfig
from tokenmill.metrics.stats import IterationStats, SchedulerStats
from tokenmill.monitoring.drift import categorical_psi, cosine_distance, numeric_psi, summarize
from tokenmill.monitoring.profile import ModelProfile
from tokenmill.monitoring.signals import CENTROID, NUMERIC, SIGNALS, request_signals

logger = logging.getLogger(__name__)

# Texts waiting for the embedding model, per monitor: older ones are dropped when it lags.
MAX_PENDING_EMBEDDINGS = 64
# Characters of a prompt's end that are embedded.
EMBED_CHARS = 2000


class GaugeFamily(Protocol):
    """A labelled gauge (prometheus_client's Gauge)."""

    def labels(self, *values: str) -> Any: ...


class _Centroid:
    """Mean prompt embedding of the reference (a running sum) and of the live window."""

    def __init__(self, window: int) -> None:
        self.ref_sum: list[float] | None = None
        self.ref_count = 0
        self.live: deque[list[float]] = deque(maxlen=window)

    def add(self, vector: list[float], in_reference: bool) -> None:
        if in_reference:
            if self.ref_sum is None:
                self.ref_sum = [0.0] * len(vector)
            self.ref_sum = [a + b for a, b in zip(self.ref_sum, vector, strict=True)]
            self.ref_count += 1
        else:
            self.live.append(vector)

    def reference_mean(self) -> list[float] | None:
        if self.ref_sum is None or not self.ref_count:
            return None
        return [x / self.ref_count for x in self.ref_sum]

    def live_mean(self) -> list[float] | None:
        if not self.live:
            return None
        n = len(self.live)
        return [sum(col) / n for col in zip(*self.live, strict=True)]


class DriftMonitor:
    """One model's windows, scores and alerts (see the module)."""

    def __init__(self, model_name: str, config: MonitorConfig,
                 gauge: GaugeFamily | None = None, reference: ModelProfile | None = None,
                 reference_source: str | None = None, embeddings: bool = False) -> None:
        self.model_name = model_name
        self.config = config
        self.threshold = config.drift_threshold
        self._gauge = gauge
        self._lock = threading.Lock()
        self._reference: dict[str, list[Any]] = {s: [] for s in SIGNALS}
        self._live: dict[str, deque[Any]] = {s: deque(maxlen=config.window) for s in SIGNALS}
        self._ref_requests = 0
        self._live_requests = 0  # sequences in the live window (at most config.window)
        self._seen = 0
        self.reference_size = config.reference_size
        self.reference_source = f"the first {config.reference_size} requests"
        self._centroid = _Centroid(config.window) if embeddings else None
        # (prompt end, finished during the reference?) waiting for the embedding model; only a
        # sample is embedded when time is short (ops.registry), so the flag, not the count of
        # embeddings, says which window a vector belongs to.
        self.pending_texts: deque[tuple[str, bool]] = deque(maxlen=MAX_PENDING_EMBEDDINGS)
        if reference is not None:
            self._load_reference(reference, reference_source or "a saved profile")
        # A score at least every tenth of a window (and not before half of it is full).
        self.score_every = max(1, config.window // 10)
        self.min_live = max(1, config.window // 2)
        self._since_score = 0
        self.scores: dict[str, float | None] = dict.fromkeys(self.signals())
        self.alerting: set[str] = set()

    def signals(self) -> tuple[str, ...]:
        """The signals this monitor scores."""
        return SIGNALS + ((CENTROID,) if self._centroid is not None else ())

    def _load_reference(self, profile: ModelProfile, source: str) -> None:
        for signal, values in profile.signals.items():
            self._reference[signal] = list(values)
        self._ref_requests = self.reference_size = profile.requests
        self.reference_source = source
        if self._centroid is not None and profile.centroid is not None:
            n = max(profile.centroid_count, 1)
            self._centroid.ref_sum = [x * n for x in profile.centroid]
            self._centroid.ref_count = n

    @property
    def reference_complete(self) -> bool:
        return self._ref_requests >= self.reference_size

    # ---------------------------------------------------------------- engine thread

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        """Take the sequences that finished in one step; score every ``score_every``."""
        if not iteration.finished:
            return
        with self._lock:
            for f in iteration.finished:
                in_reference = not self.reference_complete
                self._add(request_signals(f))
                if self._centroid is not None and f.prompt:
                    self.pending_texts.append((f.prompt[-EMBED_CHARS:], in_reference))
            if self._since_score >= self.score_every and self.reference_complete:
                self._score_locked()

    def _add(self, signals: dict[str, Any]) -> None:
        self._seen += 1
        if not self.reference_complete:
            target: dict[str, Any] = self._reference
            self._ref_requests += 1
        else:
            target = self._live
            self._live_requests = min(self._live_requests + 1, self.config.window)
            self._since_score += 1
        for name, value in signals.items():
            target[name].append(value)

    def add_embeddings(self, vectors: list[list[float]], in_reference: list[bool]) -> None:
        """Prompt embeddings computed off the engine thread, each with whether its request
        finished while the reference was being taken (the pending_texts' flags)."""
        if self._centroid is None:
            return
        with self._lock:
            for v, ref in zip(vectors, in_reference, strict=True):
                self._centroid.add(v, ref)

    # ---------------------------------------------------------------- scoring

    def score(self) -> dict[str, float | None]:
        """Score every signal now (also logs crossings); the scores."""
        with self._lock:
            return self._score_locked()

    def _score_locked(self) -> dict[str, float | None]:
        self._since_score = 0
        for signal in SIGNALS:
            self._set(signal, self._psi(signal))
        if self._centroid is not None:
            ref, live = self._centroid.reference_mean(), self._centroid.live_mean()
            enough = len(self._centroid.live) >= min(self.min_live, self._centroid.ref_count)
            self._set(CENTROID, cosine_distance(ref, live) if ref and live and enough else None)
        return dict(self.scores)

    def _psi(self, signal: str) -> float | None:
        ref, live = self._reference[signal], self._live[signal]
        if not ref or len(live) < min(self.min_live, len(ref)):
            return None  # too few values to tell drift from noise
        if signal in NUMERIC:
            return numeric_psi(ref, list(live))
        return categorical_psi(ref, live)

    def _set(self, signal: str, score: float | None) -> None:
        self.scores[signal] = score
        if score is None:
            return
        if self._gauge is not None:
            self._gauge.labels(self.model_name, signal).set(score)
        what = "cosine distance" if signal == CENTROID else "PSI"
        if score >= self.threshold and signal not in self.alerting:
            self.alerting.add(signal)
            logger.warning("drift on model %r: %s %s %.3f crossed the threshold %.3g "
                           "(reference: %s; live window: %d requests)", self.model_name,
                           signal, what, score, self.threshold, self.reference_source,
                           self._live_requests)
        elif score < self.threshold and signal in self.alerting:
            self.alerting.discard(signal)
            logger.warning("drift on model %r: %s %s %.3f is back under the threshold %.3g",
                           self.model_name, signal, what, score, self.threshold)

    # ---------------------------------------------------------------- views

    def snapshot(self) -> dict[str, Any]:
        """The JSON view of this model: fresh scores, and each signal's two windows."""
        with self._lock:
            if self.reference_complete:
                self._score_locked()
            signals = {}
            for signal in SIGNALS:
                numeric = signal in NUMERIC
                signals[signal] = {
                    "score": self.scores.get(signal), "alert": signal in self.alerting,
                    "reference": summarize(self._reference[signal], numeric).as_dict(),
                    "live": summarize(list(self._live[signal]), numeric).as_dict()}
            if self._centroid is not None:
                signals[CENTROID] = {"score": self.scores.get(CENTROID),
                                     "alert": CENTROID in self.alerting,
                                     "reference": {"count": self._centroid.ref_count},
                                     "live": {"count": len(self._centroid.live)},
                                     # prompts still waiting for the embedding model
                                     "pending": len(self.pending_texts)}
            return {"model": self.model_name, "threshold": self.threshold,
                    "metric": "psi", "requests_seen": self._seen,
                    "reference": {"source": self.reference_source,
                                  "requests": self._ref_requests,
                                  "complete": self.reference_complete},
                    "live": {"requests": self._live_requests, "window": self.config.window,
                             "min_requests_to_score": self.min_live},
                    "signals": signals}

    def window_profile(self) -> ModelProfile | None:
        """The live window as a reference profile (the reference so far while the live window
        is empty); None before any request."""
        with self._lock:
            use_live = self._live_requests > 0
            source = self._live if use_live else self._reference
            requests = self._live_requests if use_live else self._ref_requests
            if not requests:
                return None
            centroid, count = None, 0
            if self._centroid is not None:
                if use_live and self._centroid.live:
                    centroid, count = self._centroid.live_mean(), len(self._centroid.live)
                elif not use_live and self._centroid.ref_count:
                    centroid, count = self._centroid.reference_mean(), self._centroid.ref_count
            return ModelProfile(requests, {s: list(v) for s, v in source.items()},
                                centroid, count)
