"""A reference profile on disk: the signal values of a window of requests, per model.

``tokenmill monitor save-reference`` writes one (from ``GET /admin/monitoring/reference``) and
``tokenmill serve --monitor-reference FILE`` reads it. Raw values rather than histograms are
kept, so that the bins follow the reference whatever window size the server runs with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.monitoring.signals import CATEGORICAL, NUMERIC

FORMAT = "tokenmill-monitor-profile"
VERSION = 1


@dataclass
class ModelProfile:
    """One model's window: each signal's values, and the mean prompt embedding if known."""

    requests: int
    signals: dict[str, list[Any]]
    centroid: list[float] | None = None
    centroid_count: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "signals": self.signals,
                "prompt_embedding_centroid": self.centroid,
                "prompt_embedding_count": self.centroid_count}


@dataclass
class Profile:
    """Every model's window, as saved."""

    models: dict[str, ModelProfile] = field(default_factory=dict)
    created: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "created": self.created,
                "models": {name: m.as_dict() for name, m in self.models.items()}}


def load_profile(path: str) -> Profile:
    """Read a profile file; ValueError naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the monitor reference {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the monitor reference {path!r} is not JSON: {e}") from None
    try:
        return parse_profile(raw)
    except ValueError as e:
        raise ValueError(f"the monitor reference {path!r}: {e}") from None


def parse_profile(raw: Any) -> Profile:
    """A profile from its JSON form; ValueError naming the bad field."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"not a monitor profile (format must be {FORMAT!r})")
    if raw.get("version") != VERSION:
        raise ValueError(f"version must be {VERSION}, got {raw.get('version')!r}")
    models = raw.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError("models must be a non-empty object")
    out = Profile(created=raw.get("created") if isinstance(raw.get("created"), str) else None)
    for name, m in models.items():
        out.models[name] = _parse_model(name, m)
    return out


def _parse_model(name: str, m: Any) -> ModelProfile:
    where = f"models.{name}"
    if not isinstance(m, dict) or not isinstance(m.get("signals"), dict):
        raise ValueError(f"{where}.signals must be an object")
    requests = m.get("requests")
    if not isinstance(requests, int) or isinstance(requests, bool) or requests < 1:
        raise ValueError(f"{where}.requests must be a positive integer")
    signals: dict[str, list[Any]] = {}
    for signal, values in m["signals"].items():
        if signal not in NUMERIC and signal not in CATEGORICAL:
            raise ValueError(f"{where}.signals.{signal} is not a signal; known: "
                             f"{', '.join(NUMERIC + CATEGORICAL)}")
        ok = _is_number if signal in NUMERIC else _is_category
        if not isinstance(values, list) or not all(ok(v) for v in values):
            kind = "finite numbers" if signal in NUMERIC else "strings"
            raise ValueError(f"{where}.signals.{signal} must be a list of {kind}")
        signals[signal] = [float(v) for v in values] if signal in NUMERIC else list(values)
    centroid = m.get("prompt_embedding_centroid")
    if centroid is not None and (not isinstance(centroid, list) or not centroid
                                 or not all(_is_number(v) for v in centroid)):
        raise ValueError(f"{where}.prompt_embedding_centroid must be a list of numbers or null")
    count = m.get("prompt_embedding_count", 0)
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"{where}.prompt_embedding_count must be an integer >= 0")
    return ModelProfile(requests, signals, centroid, count if centroid is not None else 0)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_category(v: Any) -> bool:
    return isinstance(v, str)
