"""/metrics over every replica: each replica posts its Prometheus exposition to a small named
actor (``MetricsBoard``, created by the ingress) every ``PUSH_INTERVAL_S`` seconds; the
ingress answers /metrics with all of them, each sample labelled ``replica="NAME"``, or with
one replica's own exposition (``/metrics?replica=NAME``).

A Ray Serve handle reaches *a* replica, never a chosen one: hence the push.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

BOARD_NAME = "tokenmill-metrics-board"
PUSH_INTERVAL_S = 1.0
# A replica silent this long is gone (killed, scaled down): its numbers leave /metrics.
STALE_AFTER_S = 10.0


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest exposition of each replica."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        """Record ``replica``'s exposition."""
        self._texts[replica] = (time.monotonic(), text)

    def latest(self) -> dict[str, str]:
        """The expositions of the replicas heard from lately."""
        now = time.monotonic()
        self._texts = {r: v for r, v in self._texts.items() if now - v[0] < STALE_AFTER_S}
        return {r: text for r, (_, text) in self._texts.items()}


def open_board() -> ray.actor.ActorHandle:
    """The board, created if it is not there yet (by the ingress, which owns it)."""
    return MetricsBoard.options(name=BOARD_NAME, get_if_exists=True).remote()


def find_board() -> ray.actor.ActorHandle | None:
    """The board if the ingress has created it."""
    try:
        return ray.get_actor(BOARD_NAME)
    except ValueError:
        return None


class _Labelled:
    """A collector that yields the families of several expositions, each sample labelled
    with its replica."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                             family.type, family.unit))
                into.samples += [s._replace(labels={**s.labels, "replica": replica})
                                 for s in family.samples]
        yield from merged.values()


def aggregate(texts: dict[str, str]) -> bytes:
    """One exposition of every replica's metrics, labelled ``replica``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Labelled(texts))  # type: ignore[arg-type]
    return generate_latest(registry)
