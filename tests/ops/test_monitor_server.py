"""The drift monitor in a real server on the embedded model: short English prompts as the
reference, more of them stay under the threshold, long Russian prompts cross it (gauge, JSON
view, log warning); the admin key guards the view; `tokenmill monitor save-reference` and
`--monitor-reference` round-trip a profile."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from server_harness import Server, start_server  # noqa: E402

KEY = "monitor-admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
WINDOW = 40
MONITOR_ARGS = ("--monitor-reference-size", str(WINDOW), "--monitor-window", str(WINDOW),
                "--drift-threshold", "0.25", "--max-num-seqs", "8",
                # Every prompt embedded (the default samples them within 1% of the time).
                "--monitor-embedding-budget", "1.0")
WORDS = "the a cat dog runs sees big small red house tree river blue fast slow".split()
RUSSIAN = "кошка собака бежит видит большой маленький красный дом дерево река".split()


def prompts(words: list[str], count: int, length: tuple[int, int], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(*length)))
            for _ in range(count)]


# The same distribution exactly: the reference's prompts again, in another order.
ENGLISH = prompts(WORDS, WINDOW, (4, 9), seed=1)
ENGLISH_AGAIN = random.Random(2).sample(ENGLISH, len(ENGLISH))
LONG_RUSSIAN = prompts(RUSSIAN, WINDOW, (40, 60), seed=3)


def send(server: Server, texts: list[str]) -> None:
    def one(text: str) -> None:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": server.model, "prompt": text, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, texts))


def monitoring(server: Server) -> dict:
    r = httpx.get(f"{server.url}/admin/monitoring", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    (model,) = r.json()["models"]
    return model


def embedded_live_window(server: Server, deadline_s: float = 120.0) -> dict:
    """The monitoring view once the prompt embeddings of a whole live window are in: they are
    computed off the engine thread, a round a second, so they lag the requests (by more on a
    busy machine). Polls, bounded by ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        view = monitoring(server)
        embedding = view["signals"]["prompt_embedding"]
        if embedding["live"]["count"] >= WINDOW or time.monotonic() > end:
            return view
        time.sleep(0.5)


def drift_gauges(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenmill:drift_score{"):
            labels, value = line.rsplit(" ", 1)
            signal = labels.split('signal="')[1].split('"')[0]
            out[signal] = float(value)
    return out


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--admin-key", KEY, *MONITOR_ARGS)
    yield s
    assert s.stop() == 0, s.log()


def test_the_monitoring_view_needs_the_admin_key(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/admin/monitoring", "/admin/monitoring/reference"):
            r = httpx.get(f"{server.url}{path}", headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_admin_key"


def test_drift_crosses_the_threshold_only_when_the_traffic_changes(
        server: Server, tmp_path: Path) -> None:
    assert httpx.get(f"{server.url}/admin/monitoring/reference", headers=ADMIN,
                     timeout=10).status_code == 409  # nothing finished yet
    send(server, ENGLISH)
    view = monitoring(server)
    assert view["reference"]["complete"] and view["reference"]["requests"] == WINDOW
    assert all(s["score"] is None for s in view["signals"].values())  # no live window yet

    send(server, ENGLISH_AGAIN)
    view = embedded_live_window(server)
    scores = {k: s["score"] for k, s in view["signals"].items()}
    assert all(v is not None and v < 0.25 for v in scores.values()), scores
    assert "crossed the threshold" not in server.log()
    # Save this (English) live window for the next server.
    saved = tmp_path / "reference.json"
    run = subprocess.run([sys.executable, "-m", "tokenmill", "monitor", "save-reference",
                          "--url", server.url, "--admin-key", KEY, "--output", str(saved)],
                         capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert run.returncode == 0, run.stderr
    assert f"saved {WINDOW} requests of {server.model!r}" in run.stdout
    profile = json.loads(saved.read_text())
    assert sorted(profile["models"][server.model]["signals"]["script"]) == ["latin"] * WINDOW

    send(server, LONG_RUSSIAN)
    view = monitoring(server)
    signals = view["signals"]
    for name in ("prompt_tokens", "script"):
        assert signals[name]["score"] > 0.25 and signals[name]["alert"], (name, signals[name])
    assert signals["script"]["live"]["shares"] == {"cyrillic": 1.0}
    assert signals["output_tokens"]["score"] < 0.25  # still two tokens each
    gauges = drift_gauges(server)
    assert gauges["prompt_tokens"] > 0.25 and gauges["script"] > 0.25
    log = server.log()
    assert "drift on model" in log and "script PSI" in log and "prompt_tokens PSI" in log
    assert log.count("crossed the threshold") >= 2

    second_server_uses_the_saved_reference(saved)


def second_server_uses_the_saved_reference(saved: Path) -> None:
    """A server started with --monitor-reference scores its first requests against it (and
    has no /admin routes without an admin key)."""
    s = start_server("--monitor-reference", str(saved), *MONITOR_ARGS)
    try:
        assert httpx.get(f"{s.url}/admin/monitoring", timeout=10).status_code == 404
        assert f"reference the profile in {saved}" in s.log()
        # Half a window is enough to score; four more make sure a periodic score saw it.
        send(s, ENGLISH[:WINDOW // 2 + 4])
        gauges = drift_gauges(s)
        assert gauges and all(v < 0.25 for v in gauges.values()), gauges
        send(s, LONG_RUSSIAN)
        gauges = drift_gauges(s)
        assert gauges["script"] > 0.25 and gauges["prompt_tokens"] > 0.25
    finally:
        assert s.stop() == 0, s.log()


def test_a_bad_reference_file_stops_the_server_before_loading(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    run = subprocess.run([sys.executable, "-m", "tokenmill", "serve", "--monitor-reference",
                          str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "not a monitor profile" in run.stderr and str(bad) in run.stderr
