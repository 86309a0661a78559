"""The usage table is pruned to ``--usage-retention-days``: at start, then at most once an
interval on a thread of its own; the current month's rows (the budgets') always stay."""

from __future__ import annotations

import calendar
import time
from pathlib import Path

import httpx
import pytest
from tenancy_harness import ADMIN, new_key, new_project, start

from tokenmill.tenancy.retention import DAY_S, TenancySettings, UsagePruner
from tokenmill.tenancy.store import TenancyStore

# 2026-06-20 12:00 UTC.
NOW = float(calendar.timegm((2026, 6, 20, 12, 0, 0)))


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def add_row(store: TenancyStore, t: float) -> None:
    store._write([("INSERT INTO usage (time, project_id, key_id, model, kind, input_tokens, "
                   "output_tokens, cost, finish_reason, latency) VALUES "
                   "(?, 'p', 'k', 'm', 'completions', 1, 1, 0.5, 'stop', 0.1)", (t,))])


def times(store: TenancyStore) -> list[float]:
    return [r["time"] for r in store.usage_rows(0, float("inf"))]


@pytest.fixture
def store(tmp_path: Path) -> TenancyStore:
    return TenancyStore(str(tmp_path))


def test_rows_past_the_retention_go_and_the_rest_stay(store: TenancyStore) -> None:
    ages = [500, 91, 89, 1]  # days
    for days in ages:
        add_row(store, NOW - days * DAY_S)
    pruner = UsagePruner(store, 90, clock=Clock(NOW))
    assert pruner.prune_now() == 2
    assert times(store) == [NOW - 89 * DAY_S, NOW - DAY_S]
    assert store.spent_since("p", 0) == 1.0


def test_the_current_months_rows_stay_whatever_the_retention(store: TenancyStore) -> None:
    month = float(calendar.timegm((2026, 6, 1, 0, 0, 0)))
    for t in (month - 60, month + 60, NOW - 60):
        add_row(store, t)
    UsagePruner(store, 1, clock=Clock(NOW)).prune_now()
    assert times(store) == [month + 60, NOW - 60]


def test_zero_keeps_everything(store: TenancyStore) -> None:
    add_row(store, NOW - 5000 * DAY_S)
    pruner = UsagePruner(store, 0, clock=Clock(NOW))
    assert pruner.prune_now() == 0 and pruner.maybe_prune() is None
    assert len(times(store)) == 1


def test_pruning_deletes_in_batches(store: TenancyStore) -> None:
    for i in range(25):
        add_row(store, NOW - 400 * DAY_S + i)
    add_row(store, NOW)
    assert store.prune_usage(NOW - 1, batch=10) == 25
    assert times(store) == [NOW]


def test_pruning_runs_off_the_caller_at_most_once_an_interval(store: TenancyStore) -> None:
    clock = Clock(NOW)
    pruner = UsagePruner(store, 30, interval_s=3600, clock=clock)
    add_row(store, NOW - 40 * DAY_S)
    first = pruner.maybe_prune()
    assert first is not None
    first.join(30)
    assert times(store) == []
    add_row(store, NOW - 40 * DAY_S)
    clock.t += 60
    assert pruner.maybe_prune() is None  # within the interval: nothing started
    assert len(times(store)) == 1
    clock.t += 3600
    second = pruner.maybe_prune()
    assert second is not None
    second.join(30)
    assert times(store) == []


def test_retention_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="usage_retention_days"):
        TenancySettings(usage_retention_days=-1)
    assert TenancySettings().usage_retention_days == 400


def test_the_server_prunes_at_start(tmp_path: Path) -> None:
    store = TenancyStore(str(tmp_path))
    old, recent = time.time() - 100 * DAY_S, time.time() - 60
    add_row(store, old)
    add_row(store, recent)
    store.close()
    server = start(tmp_path, "--usage-retention-days", "45")
    try:
        r = httpx.get(f"{server.url}/v1/organization/usage/export",
                      params={"start_time": int(old) - 10, "format": "jsonl"},
                      headers=ADMIN, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.text.splitlines()) == 1
        # The next request is answered as before, and its row is kept.
        key = new_key(server, new_project(server))["value"]
        done = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": server.model, "prompt": "hi", "max_tokens": 2})
        assert done.status_code == 200, done.text
        r = httpx.get(f"{server.url}/v1/organization/usage/export",
                      params={"start_time": int(old) - 10, "format": "jsonl"},
                      headers=ADMIN, timeout=30)
        assert len(r.text.splitlines()) == 2
    finally:
        server.stop()
