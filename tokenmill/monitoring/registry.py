"""The drift monitors of a server, one per served model name (a swapped-in version keeps its
name's monitor and reference, so what changed with the new version shows as drift)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tokenmill.config import MonitorConfig
from tokenmill.monitoring.monitor import DriftMonitor, GaugeFamily
from tokenmill.monitoring.profile import ModelProfile, Profile, load_profile

logger = logging.getLogger(__name__)

# Embeds texts: one vector per text (an embedding model's client).
EmbedFn = Callable[[list[str]], Awaitable[list[list[float]]]]
# Seconds between rounds of embedding the prompts of finished requests.
EMBED_INTERVAL_S = 1.0
# Texts per embedding call.
EMBED_BATCH = 16
# Seconds of embedding the budget can save up while the server is quiet.
EMBED_BURST_S = 1.0


class TimeBudget:
    """A bucket of seconds that fills at ``share`` of the time passing, up to ``burst``
    seconds; work may start while it holds any, and what the work took is taken out after."""

    def __init__(self, share: float, burst: float = EMBED_BURST_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.burst = burst
        self.clock = clock
        self.seconds = burst
        self._last = clock()

    def available(self) -> bool:
        now = self.clock()
        self.seconds = min(self.burst, self.seconds + (now - self._last) * self.share)
        self._last = now
        return self.seconds > 0

    def spend(self, seconds: float) -> None:
        self.seconds -= seconds


class MonitorRegistry:
    """Every served model's DriftMonitor; the reference file's profiles; the embedding loop."""

    def __init__(self, config: MonitorConfig, gauge: GaugeFamily | None = None,
                 embed: EmbedFn | None = None) -> None:
        """``embed``: the embedding model that turns on the centroid signal (None: off)."""
        self.config = config
        self.gauge = gauge
        self.embed = embed
        # The embedding model's time for monitoring is bounded: serving comes first.
        self.embed_budget = TimeBudget(config.embedding_budget)
        self.monitors: dict[str, DriftMonitor] = {}
        self.profile: Profile | None = None
        if config.reference_path is not None:
            self.profile = load_profile(config.reference_path)

    def for_model(self, name: str) -> DriftMonitor:
        """The monitor of the model served as ``name`` (made on first use)."""
        monitor = self.monitors.get(name)
        if monitor is None:
            reference = self._reference_for(name)
            monitor = DriftMonitor(name, self.config, self.gauge, reference,
                                   f"the profile in {self.config.reference_path}",
                                   embeddings=self.embed is not None)
            self.monitors[name] = monitor
            logger.info("drift monitor of %r: reference %s, live window %d, threshold %g",
                        name, monitor.reference_source, self.config.window,
                        self.config.drift_threshold)
        return monitor

    def forget(self, name: str) -> None:
        """Drop the monitor of a model that is no longer served (its gauges go with the
        model's other series)."""
        self.monitors.pop(name, None)

    def _reference_for(self, name: str) -> ModelProfile | None:
        """The saved profile of ``name``; the only one of a file that holds one, for the first
        model the server names; None without a file."""
        if self.profile is None:
            return None
        models = self.profile.models
        if name in models:
            return models[name]
        if len(models) == 1 and not self.monitors:
            (saved,) = models
            logger.info("monitor reference: the profile of %r is used for %r", saved, name)
            return models[saved]
        return None

    def snapshot(self) -> dict[str, Any]:
        """The JSON view: every model's scores and windows."""
        return {"object": "monitoring", "metric": "psi",
                "threshold": self.config.drift_threshold,
                "models": [m.snapshot() for m in self.monitors.values()]}

    def window_profile(self, model: str | None = None) -> Profile:
        """The live windows (of ``model`` only, if given) as a profile to save; ValueError
        when there is no such model or no request yet."""
        if model is not None and model not in self.monitors:
            raise ValueError(f"no monitored model is named {model!r}")
        names = [model] if model is not None else list(self.monitors)
        out = Profile(created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        for name in names:
            profile = self.monitors[name].window_profile()
            if profile is not None:
                out.models[name] = profile
        if not out.models:
            raise ValueError("no request has finished yet: there is no window to save")
        return out

    async def run_embeddings(self) -> None:
        """Embed the prompts the monitors queued, every EMBED_INTERVAL_S, until cancelled (an
        embedding failure is logged and the round skipped)."""
        if self.embed is None:
            return
        while True:
            await asyncio.sleep(EMBED_INTERVAL_S)
            for monitor in list(self.monitors.values()):
                await self.embed_pending(monitor)

    async def embed_pending(self, monitor: DriftMonitor) -> None:
        """Embed what ``monitor`` has queued, a batch at a time, while the time budget lasts
        (what is left waits; the queue keeps the newest prompts)."""
        assert self.embed is not None
        while monitor.pending_texts and self.embed_budget.available():
            batch = []
            while monitor.pending_texts and len(batch) < EMBED_BATCH:
                batch.append(monitor.pending_texts.popleft())
            texts = [text for text, _ in batch]
            start = self.embed_budget.clock()
            try:
                vectors = await self.embed(texts)
            except Exception as e:  # noqa: BLE001 - monitoring must never break serving
                logger.warning("prompt embeddings for drift monitoring failed: %s", e)
                return
            finally:
                self.embed_budget.spend(self.embed_budget.clock() - start)
            monitor.add_embeddings(vectors, [ref for _, ref in batch])
