"""The tenancy pieces on their own: the store, the limiter over a fake clock, the priority a
project allows, and the request's own priority field."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tokenmill.api.protocol import ChatCompletionRequest
from tokenmill.api.validation import sampling_params
from tokenmill.sampling_params import SamplingParams
from tokenmill.tenancy.keys import key_hash
from tokenmill.tenancy.limits import Limiter, duration, month_start
from tokenmill.tenancy.meter import Tab, current_tab, with_priority
from tokenmill.tenancy.store import TenancyStore


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store(tmp_path: Path) -> TenancyStore:
    return TenancyStore(str(tmp_path))


def test_keys_resolve_until_revoked_and_only_hashes_are_kept(store: TenancyStore) -> None:
    p = store.create_project("team", "admin")
    key, value = store.create_key(p.id, "ci", "admin")
    caller = store.caller(value)
    assert caller is not None and caller.project.id == p.id and caller.key_id == key.id
    assert store.key(p.id, key.id).last_used_at is not None
    rows = store._exec("SELECT hash FROM api_keys")
    assert [r["hash"] for r in rows] == [key_hash(value)]
    store.revoke_key(p.id, key.id, "admin")
    assert store.caller(value) is None
    assert store.caller(value + "x") is None


def test_requests_per_minute_slide(store: TenancyStore) -> None:
    clock = Clock()
    limiter = Limiter(store, clock)
    p = store.create_project("t", "admin", limits={"max_requests_per_1_minute": 2})
    assert limiter.admit(p) is None and limiter.admit(p) is None
    refusal = limiter.admit(p)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(60)
    clock.t += 30
    assert limiter.admit(p) is not None
    clock.t += 30.5  # the first two fell out of the window
    assert limiter.admit(p) is None


def test_tokens_per_minute_and_concurrency(store: TenancyStore) -> None:
    clock = Clock()
    limiter = Limiter(store, clock)
    p = store.create_project("t", "admin", limits={"max_tokens_per_1_minute": 100,
                                                   "max_concurrent_requests": 1})
    assert limiter.admit(p) is None
    assert "concurrent" in limiter.admit(p).message
    limiter.add_tokens(p.id, 60)
    clock.t += 10
    limiter.add_tokens(p.id, 50)
    limiter.release(p.id)
    refusal = limiter.admit(p)
    assert "tokens per minute" in refusal.message
    assert refusal.retry_after_s == pytest.approx(50)  # when the first 60 leave the window
    assert limiter.headers(p)["x-ratelimit-remaining-tokens"] == "0"


def test_monthly_budget_counts_this_month_only(store: TenancyStore) -> None:
    clock = Clock()
    limiter = Limiter(store, clock)
    p = store.create_project("t", "admin", limits={"monthly_budget": 1.0})
    row = {"project_id": p.id, "key_id": "k", "model": "m", "kind": "completions",
           "input_tokens": 1, "output_tokens": 1, "finish_reason": "stop", "latency": 0.1}
    store.record_usage({**row, "time": month_start(clock.t) - 1, "cost": 5.0})
    assert limiter.admit(p) is None
    limiter.release(p.id)
    store.record_usage({**row, "time": clock.t, "cost": 1.0})
    refusal = limiter.admit(p)
    assert refusal is not None and refusal.code == "insufficient_quota"


def test_durations_as_openai_writes_them() -> None:
    assert duration(0.02) == "20ms" and duration(1.5) == "1.5s" and duration(360) == "6m0s"


def test_priority_never_more_urgent_than_the_project_allows(store: TenancyStore) -> None:
    p = store.create_project("batch", "admin", priority=5)
    caller = store.caller(store.create_key(p.id, "k", "admin")[1])
    reset = current_tab.set(Tab(caller, store, Limiter(store)))
    try:
        assert with_priority(SamplingParams(priority=0)).priority == 5
        assert with_priority(SamplingParams(priority=9)).priority == 9
    finally:
        current_tab.reset(reset)
    assert with_priority(SamplingParams(priority=-3)).priority == -3  # the server key's own


def test_request_priority_field() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], priority=4)
    assert sampling_params(req, 100, max_tokens=4, logprobs=None).priority == 4
    with pytest.raises(Exception, match="priority"):
        sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                              priority=1 << 40), 100, max_tokens=4,
                        logprobs=None)


def test_audit_log_rotates_past_months_to_jsonl(store: TenancyStore) -> None:
    now = time.time()
    old = now - 70 * 86400  # two months ago at least
    store._write([("INSERT INTO audit_log (time, type, project_id, actor, details) "
                   "VALUES (?, 'api_key.created', 'proj_x', 'admin_key', '{\"id\": \"key_1\"}')",
                   (int(old),))])
    store.audit("project.updated", "proj_x", "admin_key", {"name": "now"})
    (written,) = store.rotate_audit(now)
    lines = [json.loads(x) for x in open(written, encoding="utf-8")]
    assert [(x["type"], x["details"]["id"]) for x in lines] == [("api_key.created", "key_1")]
    assert [r["type"] for r in store.audit_rows()] == ["project.updated"]
    assert store.rotate_audit(now) == []  # nothing left to move
