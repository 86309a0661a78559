"""The projects' limits hold across every server process over one tenancy store: several
processes racing for a limit of N requests admit N in total; tokens and concurrent requests
counted by one are seen by the others; a dead process's running requests stop counting."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tenancy_harness import Server, new_key, new_project, start

from tokenmill.tenancy.limits import Limiter
from tokenmill.tenancy.store import TenancyStore
from tokenmill.tenancy.windows import STALE_S


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _race(data_dir: str, project_id: str, tries: int, go: multiprocessing.Event,
          out: multiprocessing.Queue) -> None:
    store = TenancyStore(data_dir)
    limiter = Limiter(store)
    project = store.project(project_id)
    go.wait(60)
    admitted = 0
    for _ in range(tries):
        if limiter.admit(project) is None:
            admitted += 1
            limiter.release(project_id)
    out.put(admitted)


def test_processes_racing_admit_n_requests_in_total(tmp_path: Path) -> None:
    store = TenancyStore(str(tmp_path))
    p = store.create_project("t", "admin", limits={"max_requests_per_1_minute": 20})
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), p.id, 15, go, out))
             for _ in range(3)]
    for proc in procs:
        proc.start()
    go.set()
    counts = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(60)
    assert sum(counts) == 20, counts


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[TenancyStore, Limiter, Limiter, Clock]]:
    """Two processes' handles on one store (one clock)."""
    clock = Clock()
    a, b = TenancyStore(str(tmp_path)), TenancyStore(str(tmp_path))
    la, lb = Limiter(a, clock), Limiter(b, clock)
    yield a, la, lb, clock
    la.close()
    lb.close()


def test_concurrent_requests_count_across_handles(two: tuple) -> None:
    store, a, b, _ = two
    p = store.create_project("t", "admin", limits={"max_concurrent_requests": 3})
    assert a.admit(p) is None and a.admit(p) is None and b.admit(p) is None
    assert "concurrent" in b.admit(p).message and "concurrent" in a.admit(p).message
    a.release(p.id)
    assert b.admit(p) is None
    assert a.admit(p) is not None


def test_tokens_count_across_handles(two: tuple) -> None:
    store, a, b, clock = two
    p = store.create_project("t", "admin", limits={"max_tokens_per_1_minute": 100})
    assert a.admit(p) is None
    a.add_tokens(p.id, 70)
    clock.t += 1  # a later token writes the earlier ones
    a.add_tokens(p.id, 40)
    assert b.headers(p)["x-ratelimit-remaining-tokens"] == "30"
    a.release(p.id)  # writes the last 40 too
    assert b.headers(p)["x-ratelimit-remaining-tokens"] == "0"
    refusal = b.admit(p)
    assert refusal is not None and "tokens per minute" in refusal.message
    assert refusal.retry_after_s == pytest.approx(59)  # when the first 70 leave the window
    clock.t += 60
    assert b.admit(p) is None


def test_a_dead_processs_requests_stop_counting(two: tuple) -> None:
    store, a, b, clock = two
    p = store.create_project("t", "admin", limits={"max_concurrent_requests": 1})
    assert a.admit(p) is None
    a.close()  # as SIGKILL: no release, no more heartbeats
    assert b.admit(p) is not None
    clock.t += STALE_S + 1
    assert b.admit(p) is None


def test_a_project_without_limits_writes_nothing(two: tuple) -> None:
    store, a, _, _ = two
    p = store.create_project("free", "admin")
    for _ in range(5):
        assert a.admit(p) is None
        a.add_tokens(p.id, 10)
        a.release(p.id)
    assert store._exec("SELECT COUNT(*) AS n FROM limit_events")[0]["n"] == 0
    assert a.headers(p) == {}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """Two servers over one data folder (as two workers of one service)."""
    data = Path(tmp_path_factory.mktemp("shared"))
    first = start(data)
    try:
        second = start(data)
    except BaseException:
        first.stop()
        raise
    yield first, second
    second.stop()
    first.stop()


def test_two_servers_share_a_projects_requests_per_minute(servers: tuple) -> None:
    first, second = servers
    key = new_key(first, new_project(first, max_requests_per_1_minute=3))["value"]
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": first.model, "prompt": "hi", "max_tokens": 1}

    def post(server: Server) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=60)

    assert [post(first).status_code, post(second).status_code,
            post(first).status_code] == [200, 200, 200]
    refused = post(second)
    assert refused.status_code == 429, refused.text
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused.headers["retry-after"]) >= 1
    assert post(first).status_code == 429
    # Another project's next request is answered as before, on either server.
    other = new_key(second, new_project(second))["value"]
    done = httpx.post(f"{second.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {other}"})
    assert done.status_code == 200 and done.json()["choices"][0]["text"] is not None


def test_a_new_handle_drops_past_minutes_and_gone_processes(tmp_path: Path) -> None:
    clock = Clock()
    store = TenancyStore(str(tmp_path))
    p = store.create_project("t", "admin", limits={"max_concurrent_requests": 5})
    old = Limiter(store, clock)
    assert old.admit(p) is None
    old.close()
    clock.t += 2 * 86400
    fresh = Limiter(store, clock)
    try:
        for table in ("limit_events", "limit_running", "limit_processes"):
            assert store._exec(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"] == 0, table
        assert fresh.admit(p) is None
    finally:
        fresh.close()
