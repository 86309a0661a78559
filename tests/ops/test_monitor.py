"""The drift monitor fed with made-up finished sequences: scores, gauges, warnings, the
reference profile, and the embedding centroid with a fake embedder."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.config import MonitorConfig
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from tokenmill.monitoring import DriftMonitor, MonitorRegistry
from tokenmill.monitoring.profile import load_profile, parse_profile
from tokenmill.monitoring.registry import TimeBudget

WORDS = "the a cat dog runs sees big small red house tree river blue fast slow".split()
RUSSIAN = "кошка собака бежит видит большой маленький красный дом дерево река".split()


def english(rng: random.Random) -> FinishedRequestStats:
    """A short English prompt, answered in 8 to 16 tokens (eos or max_tokens)."""
    n = rng.randint(4, 9)
    text = " ".join(rng.choice(WORDS) for _ in range(n)) + "?"
    out = rng.randint(8, 16)
    finish = rng.choice(["stop", "length"])
    return FinishedRequestStats(finish, 0.5, 0.01, n + 2, out, text, None,
                                rng.uniform(-1.5, -0.5))


def russian(rng: random.Random) -> FinishedRequestStats:
    """A long Russian prompt."""
    n = rng.randint(150, 250)
    text = " ".join(rng.choice(RUSSIAN) for _ in range(n)) + "?"
    f = english(rng)
    f.prompt, f.num_prompt_tokens = text, 3 * n
    return f


def feed(monitor: DriftMonitor, make, count: int, rng: random.Random) -> None:
    for _ in range(count):
        monitor.record(SchedulerStats(), IterationStats(finished=[make(rng)]))


def gauges(metrics: PrometheusMetrics) -> dict[tuple[str, str], float]:
    text = metrics.render()[0].decode()
    return {(s.labels["model_name"], s.labels["signal"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "tokenmill:drift_score"}


CONFIG = MonitorConfig(reference_size=100, window=100, drift_threshold=0.25)


def test_a_shift_in_length_and_script_crosses_the_same_distribution_does_not(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = PrometheusMetrics()
    monitor = DriftMonitor("m", CONFIG, metrics.drift_score)
    rng = random.Random(1)
    caplog.set_level(logging.WARNING, logger="tokenmill.monitoring.monitor")
    feed(monitor, english, 100, rng)
    assert monitor.reference_complete and not gauges(metrics)  # nothing live yet
    feed(monitor, english, 100, rng)
    same = monitor.score()
    assert all(s is not None and s < 0.25 for s in same.values()), same
    assert not caplog.records and not monitor.alerting

    feed(monitor, russian, 100, rng)
    shifted = monitor.score()
    assert shifted["prompt_tokens"] > 1.0 and shifted["script"] > 1.0
    # Outputs were drawn from the same distribution: no alert on them.
    for signal in ("output_tokens", "mean_logprob", "finish_reason", "stop_kind"):
        assert shifted[signal] < 0.25, (signal, shifted)
    assert monitor.alerting == {"prompt_tokens", "script"}
    g = gauges(metrics)
    assert g[("m", "prompt_tokens")] == pytest.approx(shifted["prompt_tokens"])
    assert g[("m", "script")] == pytest.approx(shifted["script"])
    crossed = [r.getMessage() for r in caplog.records]
    assert len(crossed) == 2 and all("crossed the threshold" in m for m in crossed)
    assert any("prompt_tokens PSI" in m for m in crossed)

    caplog.clear()
    feed(monitor, english, 100, rng)  # the live window is English again
    monitor.score()
    assert not monitor.alerting
    back = [r.getMessage() for r in caplog.records]
    assert len(back) == 2 and all("back under the threshold" in m for m in back)


def test_scores_come_periodically_and_not_before_half_a_window() -> None:
    monitor = DriftMonitor("m", CONFIG)
    rng = random.Random(2)
    feed(monitor, english, 100, rng)
    feed(monitor, russian, 40, rng)  # live window 40 < 50: too few to score
    assert monitor.scores["prompt_tokens"] is None
    feed(monitor, russian, 20, rng)  # the next periodic score (every 10) sees 60
    assert monitor.scores["prompt_tokens"] > 1.0


def test_snapshot_shows_both_windows() -> None:
    monitor = DriftMonitor("m", CONFIG)
    rng = random.Random(3)
    feed(monitor, english, 100, rng)
    feed(monitor, russian, 60, rng)
    view = monitor.snapshot()
    json.dumps(view)  # JSON as it is
    assert view["reference"] == {"source": "the first 100 requests", "requests": 100,
                                 "complete": True}
    assert view["live"]["requests"] == 60
    script = view["signals"]["script"]
    assert script["reference"]["shares"] == {"latin": 1.0}
    assert script["live"]["shares"] == {"cyrillic": 1.0}
    assert script["alert"] is True and script["score"] > 1.0
    assert view["signals"]["prompt_tokens"]["live"]["mean"] > 400


def test_saved_profile_is_the_reference_of_the_next_server(tmp_path) -> None:
    rng = random.Random(4)
    first = MonitorRegistry(CONFIG)
    monitor = first.for_model("m")
    feed(monitor, english, 150, rng)
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(first.window_profile().as_dict()))
    profile = load_profile(str(path))
    assert profile.models["m"].requests == 50  # the live window, not the reference
    second = MonitorRegistry(MonitorConfig(reference_path=str(path), window=100))
    loaded = second.for_model("m")
    assert loaded.reference_complete and "ref.json" in loaded.reference_source
    feed(loaded, russian, 60, rng)  # scored from the first request on: no warm-up
    assert loaded.scores["script"] > 1.0


def test_a_single_saved_model_serves_a_server_whose_model_has_another_name(tmp_path) -> None:
    registry = MonitorRegistry(CONFIG)
    feed(registry.for_model("old-name"), english, 30, random.Random(5))
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(registry.window_profile().as_dict()))
    other = MonitorRegistry(MonitorConfig(reference_path=str(path)))
    assert other.for_model("new-name").reference_size == 30
    assert not other.for_model("second").reference_complete  # only the first gets it


def test_window_profile_errors() -> None:
    registry = MonitorRegistry(CONFIG)
    registry.for_model("m")
    with pytest.raises(ValueError, match="no request has finished"):
        registry.window_profile()
    with pytest.raises(ValueError, match="no monitored model is named 'x'"):
        registry.window_profile("x")


@pytest.mark.parametrize(("raw", "message"), [
    ([], "not a monitor profile"),
    ({"format": "tokenmill-monitor-profile", "version": 2}, "version must be 1"),
    ({"format": "tokenmill-monitor-profile", "version": 1, "models": {}}, "non-empty"),
    ({"format": "tokenmill-monitor-profile", "version": 1,
      "models": {"m": {"requests": 3, "signals": {"bogus": []}}}}, "models.m.signals.bogus"),
    ({"format": "tokenmill-monitor-profile", "version": 1,
      "models": {"m": {"requests": 3, "signals": {"prompt_tokens": ["x"]}}}},
     "prompt_tokens must be a list of finite numbers"),
    ({"format": "tokenmill-monitor-profile", "version": 1,
      "models": {"m": {"requests": 0, "signals": {}}}}, "requests must be a positive"),
])
def test_bad_profiles_name_the_field(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_profile(raw)


def test_unreadable_reference_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read the monitor reference"):
        MonitorRegistry(MonitorConfig(reference_path=str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="is not JSON"):
        load_profile(str(bad))


def test_prompt_embedding_centroid_with_a_fake_embedder() -> None:
    # Two "languages" whose embeddings point different ways.
    async def embed(texts: list[str]) -> list[list[float]]:
        return [[0.0, 1.0] if any("\u0400" <= c <= "\u04ff" for c in t) else [1.0, 0.1]
                for t in texts]

    metrics = PrometheusMetrics()
    registry = MonitorRegistry(CONFIG, metrics.drift_score, embed=embed)
    monitor = registry.for_model("m")
    assert "prompt_embedding" in monitor.signals()
    rng = random.Random(6)

    def run(make, count: int) -> None:
        for _ in range(count // 10):  # the server embeds in rounds while requests finish
            feed(monitor, make, 10, rng)
            asyncio.run(registry.embed_pending(monitor))

    run(english, 100)
    run(english, 60)
    assert monitor.score()["prompt_embedding"] == pytest.approx(0.0, abs=1e-9)
    run(russian, 100)
    score = monitor.score()["prompt_embedding"]
    assert score > 0.25 and "prompt_embedding" in monitor.alerting
    assert gauges(metrics)[("m", "prompt_embedding")] == pytest.approx(score)


def test_an_embedder_failure_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(texts: list[str]) -> list[list[float]]:
        raise RuntimeError("the embedding model is gone")

    registry = MonitorRegistry(CONFIG, embed=broken)
    monitor = registry.for_model("m")
    feed(monitor, english, 5, random.Random(7))
    asyncio.run(registry.embed_pending(monitor))
    assert "embedding model is gone" in caplog.text


def test_serve_options() -> None:
    from tokenmill.cli import build_parser
    from tokenmill.server.monitor_cli import monitor_config_from_args

    args = build_parser().parse_args(["serve", "--monitor-window", "50", "--drift-threshold",
                                      "0.1", "--monitor-reference", "ref.json"])
    assert monitor_config_from_args(args) == MonitorConfig(
        window=50, drift_threshold=0.1, reference_path="ref.json")
    off = build_parser().parse_args(["serve", "--no-monitor"])
    assert not monitor_config_from_args(off).enabled
    with pytest.raises(ValueError, match="monitor window must be >= 1"):
        MonitorConfig(window=0)
    with pytest.raises(ValueError, match="drift_threshold must be positive"):
        MonitorConfig(drift_threshold=0)


def test_prompt_embeddings_stay_within_their_time_budget() -> None:
    # A fake clock: each embedding call of the fake embedder takes 0.5 s.
    now = [0.0]

    async def slow_embed(texts: list[str]) -> list[list[float]]:
        now[0] += 0.5
        return [[1.0, 0.0] for _ in texts]

    registry = MonitorRegistry(MonitorConfig(reference_size=1000, window=100,
                                             embedding_budget=0.01), embed=slow_embed)
    registry.embed_budget = TimeBudget(0.01, burst=1.0, clock=lambda: now[0])
    monitor = registry.for_model("m")
    rng = random.Random(8)
    feed(monitor, english, 64, rng)
    asyncio.run(registry.embed_pending(monitor))
    # The 1 s saved up (and the 1% of the 1 s the calls took) pays for three calls of 16
    # prompts, the last one on credit; the rest wait.
    assert monitor._centroid is not None and monitor._centroid.ref_count == 48
    assert len(monitor.pending_texts) == 16
    asyncio.run(registry.embed_pending(monitor))
    assert monitor._centroid.ref_count == 48  # in debt: nothing runs
    now[0] += 50.0  # 50 s of serving earn 0.5 s of embedding: the debt is paid, one more call
    asyncio.run(registry.embed_pending(monitor))
    assert monitor._centroid.ref_count == 64 and not monitor.pending_texts
    # Over a long run the embedder's share of the time stays near the budget.
    spent = 0.0
    for _ in range(200):
        feed(monitor, english, 16, rng)
        before = now[0]
        asyncio.run(registry.embed_pending(monitor))
        spent += now[0] - before
        now[0] += 10.0
    assert spent / now[0] <= 0.011


def test_time_budget_saves_up_no_more_than_its_burst() -> None:
    now = [0.0]
    budget = TimeBudget(0.5, burst=2.0, clock=lambda: now[0])
    budget.spend(3.0)
    assert not budget.available() and budget.seconds == pytest.approx(-1.0)
    now[0] = 1.0  # half of each second passing comes back
    assert not budget.available() and budget.seconds == pytest.approx(-0.5)
    now[0] = 3.0
    assert budget.available() and budget.seconds == pytest.approx(0.5)
    now[0] = 100.0
    assert budget.available() and budget.seconds == pytest.approx(2.0)
