"""What each request costs: compute time, energy and money, shared out step by step.

Every engine step is timed and its energy read (or estimated) by a :class:`StepMeter`; the
step's StepStats reach a :class:`StepAccountant`, which prices the step and gives each request
that had tokens in it the share of it that its tokens are of the step's tokens. A
request's totals therefore add up, over all requests, to the time, energy and cost of every
step the engine ran.

Energy comes from real counters through Zeus (https://ml.energy/zeus): the CPU packages' RAPL
counters (Linux powercap) and NVIDIA GPUs' (NVML) or AMD GPUs' energy counters. Where the CPU's
counters cannot be read (most VMs, this machine), the CPU part is estimated from the process's
CPU time and a power per core (``cpu_watts`` for the cores the process may use), and every
number that includes it says ``estimated``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.metrics.stats import StepStats
from tokenmill.outputs import ComputeUsage

logger = logging.getLogger(__name__)

# A guess of one busy server core's power where no counter says better (W): modern server
# CPUs draw roughly 200-400 W for 32-64 cores under load.
DEFAULT_WATTS_PER_CORE = 6.0


def usable_cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class EnergyMeter:
    """Joules used since the meter was made: read from Zeus's counters where the machine has
    them, the CPU estimated from process CPU time where it has none."""

    def __init__(self, cpu_watts: float | None = None, use_counters: bool = True) -> None:
        cores = usable_cores()
        self.cpu_watts = cpu_watts if cpu_watts is not None else DEFAULT_WATTS_PER_CORE * cores
        self._watts_per_cpu_second = self.cpu_watts / cores
        self._cpus, self._gpus = _zeus_devices() if use_counters else (None, None)
        self.estimated = self._cpus is None
        self.sources = (["rapl"] if self._cpus is not None else ["cpu-time estimate"]) + (
            ["gpu"] if self._gpus is not None else [])
        notice(f"energy: {', '.join(self.sources)}")
        self._start_mj = self._counters_mj()
        self._start_cpu_s = time.process_time()

    def read(self) -> float:
        """Joules since the meter was made."""
        joules = (self._counters_mj() - self._start_mj) / 1000.0
        if self._cpus is None:
            joules += (time.process_time() - self._start_cpu_s) * self._watts_per_cpu_second
        return joules

    def _counters_mj(self) -> float:
        total = 0.0
        if self._cpus is not None:
            for i in range(len(self._cpus)):
                m = self._cpus.get_total_energy_consumption(i)
                total += m.cpu_mj + (m.dram_mj or 0.0)
        if self._gpus is not None:
            for i in range(len(self._gpus)):
                total += float(self._gpus.get_total_energy_consumption(i))
        return total


# Where the counters Zeus reads show up: the kernel's RAPL tree (Intel, and AMD's Zen through
# the same driver), NVIDIA's driver, AMD's GPU driver.
COUNTER_PATHS = ("/sys/class/powercap/intel-rapl", "/sys/class/powercap/intel-rapl:0",
                 "/proc/driver/nvidia", "/dev/kfd")


@functools.cache
def notice(message: str) -> None:
    """Log ``message`` once per process: every engine makes a meter, but the machine and its
    counters are one (a server of two models said each notice twice)."""
    logger.info(message)


def counters_visible(paths: tuple[str, ...] | None = None) -> bool:
    """Whether any energy counter Zeus could read is there at all (``paths``: COUNTER_PATHS)."""
    return any(os.path.exists(p) for p in (COUNTER_PATHS if paths is None else paths))


def _zeus_devices() -> tuple[object | None, object | None]:
    """Zeus's CPU (RAPL) and GPU managers, each None where the machine has no readable
    counter (or Zeus is not installed). Where no counter is visible Zeus is not imported: its
    GPU modules take ~0.25 s of every start, for nothing on a VM or a laptop without RAPL."""
    if not counters_visible():
        notice("no energy counter on this machine (no RAPL in /sys/class/powercap, no GPU "
               "driver): CPU energy is estimated from CPU time")
        return None, None
    try:
        from zeus.device import get_cpus, get_gpus
    except ImportError:  # an optional dependency: the estimate still works
        notice("zeus is not installed: energy is estimated from CPU time")
        return None, None
    cpus = gpus = None
    # Zeus logs a warning for every GPU library it cannot load (AMD's on an NVIDIA or CPU-only
    # machine): not news here, the outcome is logged below.
    zeus_log = logging.getLogger("zeus")
    level = zeus_log.level
    zeus_log.setLevel(logging.ERROR)
    try:
        cpus = get_cpus()
        if len(cpus) == 0:
            cpus = None
    except Exception as e:  # noqa: BLE001 - any failure means: no counter to read
        notice(f"no CPU energy counter ({e}): CPU energy is estimated from CPU time")
    try:
        gpus = get_gpus()
        if len(gpus) == 0:
            gpus = None
    except Exception:  # noqa: BLE001 - no GPU counter: nothing to add
        gpus = None
    finally:
        zeus_log.setLevel(level)
    return cpus, gpus


class StepMeter:
    """Time and energy of one step at a time: :meth:`start` when the step begins,
    :meth:`stop` when its tokens are back. The engine core reads it like a clock; what the
    readings are worth is for the consumers of its StepStats (:class:`StepAccountant`)."""

    def __init__(self, energy: EnergyMeter) -> None:
        self.energy = energy
        self._t0 = 0.0
        self._e0 = 0.0

    @property
    def estimated(self) -> bool:
        """Whether the joules include the CPU-time estimate (no counter to read)."""
        return self.energy.estimated

    def start(self) -> None:
        """A step begins."""
        self._t0 = time.perf_counter()
        self._e0 = self.energy.read()

    def stop(self) -> tuple[float, float]:
        """Seconds and joules since :meth:`start`."""
        seconds = time.perf_counter() - self._t0
        return seconds, max(self.energy.read() - self._e0, 0.0)


@dataclass
class StepAccountant:
    """Prices each step and shares its time, energy and cost out to its requests by tokens: a
    step consumer (called with each step's StepStats)."""

    meter: EnergyMeter  # where the engine's joules come from (its sources, its watts)
    cost_per_hour: float = 0.0
    # Where each request's share goes (the engine: the request's usage); None: nowhere.
    charge: Callable[[str, ComputeUsage], None] | None = None
    # Every step's usage since the engine started.
    totals: ComputeUsage = field(default_factory=ComputeUsage)

    def __call__(self, stats: StepStats) -> None:
        """Account one step and charge each of its requests its share."""
        for rid, share in self.account(stats).items():
            if self.charge is not None:
                self.charge(rid, share)

    def account(self, stats: StepStats) -> dict[str, ComputeUsage]:
        """Add the step to the totals; each request's share (by its scheduled tokens)."""
        step = ComputeUsage(stats.seconds, stats.energy_joules,
                            stats.seconds * self.cost_per_hour / 3600.0, stats.energy_estimated)
        self.totals.add(step)
        tokens = stats.num_scheduled_tokens
        n = sum(tokens.values())
        if not n:
            return {}
        return {rid: step.scaled(k / n) for rid, k in tokens.items()}
