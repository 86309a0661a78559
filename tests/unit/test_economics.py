"""Compute, energy and cost per request: step shares add up to the steps, the estimate where
the machine has no energy counter, and the engine's per-request totals."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.metrics import economics
from tokenmill.metrics.economics import EnergyMeter, StepAccountant, StepMeter
from tokenmill.metrics.stats import StepStats
from tokenmill.outputs import ComputeUsage


def test_step_shares_add_up_to_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 12.5])
    monkeypatch.setattr(economics.time, "perf_counter", lambda: next(clock))
    meter = EnergyMeter(cpu_watts=20.0, use_counters=False)
    joules = iter([100.0, 150.0])
    monkeypatch.setattr(meter, "read", lambda: next(joules))
    step = StepMeter(meter)
    step.start()
    seconds, energy = step.stop()
    assert (seconds, energy) == (pytest.approx(2.5), pytest.approx(50.0))
    shares: dict[str, ComputeUsage] = {}
    acct = StepAccountant(meter, cost_per_hour=3.6, charge=shares.__setitem__)
    tokens = {"a": 1, "b": 3, "c": 6}
    acct(StepStats(tokens, batch_size=3, num_batched_tokens=10, seconds=seconds,
                   energy_joules=energy, energy_estimated=step.estimated))
    assert shares["a"].compute_seconds == pytest.approx(0.25)
    assert shares["c"].energy_joules == pytest.approx(30.0)
    total = ComputeUsage.total(list(shares.values()))
    assert total.compute_seconds == pytest.approx(2.5)
    assert total.energy_joules == pytest.approx(50.0)
    assert total.cost_usd == pytest.approx(2.5 * 3.6 / 3600)
    assert acct.totals.compute_seconds == pytest.approx(2.5)
    assert all(s.energy_estimated for s in shares.values())


def test_without_counters_energy_is_cpu_time_times_watts(monkeypatch) -> None:
    cpu = iter([5.0, 7.0])
    monkeypatch.setattr(economics.time, "process_time", lambda: next(cpu))
    monkeypatch.setattr(economics, "usable_cores", lambda: 4)
    meter = EnergyMeter(cpu_watts=40.0, use_counters=False)
    assert meter.estimated and meter.sources == ["cpu-time estimate"]
    assert meter.read() == pytest.approx(2.0 * 40.0 / 4)


def test_this_machine_marks_its_energy_estimated() -> None:
    """No readable RAPL counter in this VM (and no GPU): Zeus finds none, so the estimate is
    used and says so. (Where a counter exists this test has nothing to check.)"""
    meter = EnergyMeter()
    if not meter.estimated:
        pytest.skip(f"this machine has energy counters: {meter.sources}")
    assert "cpu-time estimate" in meter.sources and meter.cpu_watts > 0


def test_per_request_usage_adds_up_to_the_engine_steps() -> None:
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=32 << 20, cost_per_hour=7.2)
    outs = llm.generate(["Hello", "The capital of France is", "1, 2, 3,"],
                        SamplingParams(max_tokens=12, temperature=0, n=2))
    per_request = [o.metrics.usage for o in outs]
    assert all(u.compute_seconds > 0 and u.energy_joules > 0 for u in per_request)
    total = ComputeUsage.total(per_request)
    steps = llm.engine.core.accountant.totals
    assert total.compute_seconds == pytest.approx(steps.compute_seconds, rel=1e-9)
    assert total.energy_joules == pytest.approx(steps.energy_joules, rel=1e-9)
    assert total.cost_usd == pytest.approx(steps.compute_seconds * 7.2 / 3600, rel=1e-9)


def test_no_visible_counter_skips_zeus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a RAPL tree or a GPU driver the meter does not even import Zeus (its GPU
    modules cost every start ~0.25 s): a failing import proves it was never tried."""
    monkeypatch.setattr(economics, "COUNTER_PATHS", ("/nonexistent/tokenmill-rapl",))
    import builtins

    real_import = builtins.__import__

    def no_zeus(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name.startswith("zeus"):
            raise AssertionError("zeus was imported")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_zeus)
    meter = EnergyMeter()
    assert meter.estimated and meter.sources == ["cpu-time estimate"]


def test_counters_visible_looks_at_the_paths(tmp_path) -> None:
    assert not economics.counters_visible((str(tmp_path / "absent"),))
    assert economics.counters_visible((str(tmp_path / "absent"), str(tmp_path)))
