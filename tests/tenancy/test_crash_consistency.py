"""The key store stays consistent when the server is killed (SIGKILL) in the middle of
writes: after a restart the database passes SQLite's integrity check, every key whose
creation was answered works, every revocation that was answered holds, and each key's audit
record is there (a key and its audit record are one transaction)."""

from __future__ import annotations

import signal
import sqlite3
import threading
from pathlib import Path

import httpx
import openai
from tenancy_harness import ADMIN, admin, new_project, start


def test_sigkill_mid_writes_leaves_a_consistent_store(tmp_path: Path) -> None:
    server = start(tmp_path)
    pid = new_project(server)
    made: list[dict] = []
    revoked: list[str] = []
    stop = threading.Event()

    def write_keys() -> None:
        url = f"{server.url}/v1/organization/projects/{pid}/api_keys"
        with httpx.Client(headers=ADMIN, timeout=10) as http:
            while not stop.is_set():
                try:
                    r = http.post(url, json={"name": "k"})
                    made.append(r.json())
                    if len(made) % 3 == 0:
                        key_id = made[-2]["id"]
                        if http.delete(f"{url}/{key_id}").status_code == 200:
                            revoked.append(key_id)
                except (httpx.HTTPError, ValueError):
                    return

    writers = [threading.Thread(target=write_keys) for _ in range(3)]
    for t in writers:
        t.start()
    while len(made) < 30:
        threading.Event().wait(0.05)
    server.stop(signal.SIGKILL)
    stop.set()
    for t in writers:
        t.join(30)

    db = sqlite3.connect(tmp_path / "tenancy.sqlite")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    keys = {r[0] for r in db.execute("SELECT id FROM api_keys")}
    deleted = {r[0] for r in db.execute("SELECT id FROM api_keys WHERE deleted_at IS NOT NULL")}
    answered = [m for m in made if "id" in m]
    # Every answered creation and revocation was committed before it was answered.
    assert {m["id"] for m in answered} <= keys and set(revoked) <= deleted
    audited = {r[0] for r in db.execute(
        "SELECT json_extract(details, '$.id') FROM audit_log WHERE type = 'api_key.created'")}
    assert keys == audited
    db.close()

    again = start(tmp_path)
    try:
        listed = {k["id"] for k in admin(again, "GET", f"/projects/{pid}/api_keys",
                                         params={"limit": 100}).json()["data"]}
        assert not listed & deleted
        live = [m for m in answered if m["id"] not in revoked]
        for m in (live[0], live[-1]):
            c = openai.OpenAI(base_url=f"{again.url}/v1", api_key=m["value"], max_retries=0)
            assert c.models.list().data
        gone = next(m for m in answered if m["id"] in revoked)
        c = openai.OpenAI(base_url=f"{again.url}/v1", api_key=gone["value"], max_retries=0)
        try:
            c.models.list()
            raise AssertionError("a revoked key works after the restart")
        except openai.AuthenticationError:
            pass
    finally:
        again.stop()
