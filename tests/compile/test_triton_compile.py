"""Every Triton kernel of the CUDA backend compiles for sm_80 and sm_90, without a GPU.

The compile itself (~200 ptxas runs, minutes on two cores) is the ``compile`` group, outside
the default run: ``python -m pytest -m compile`` (CI runs it, .ci/run). Triton's cache is kept
between runs, so a rerun compiles only the kernels (or options, or Triton) that changed. The
tests of the check's own reporting are fast and run by default.
"""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from triton_compile_jobs import run_shard

ROOT = Path(__file__).resolve().parents[2]
# A generous bound on one check on an idle core (they take 0.2-3 s): the limit only stops a
# hang, it is no timing assertion.
SECONDS_PER_CHECK = 15.0


def check_limit_s(checks: int, shards: int, load: float, cpus: int) -> float:
    """Seconds the check may take: its busiest shard's checks at SECONDS_PER_CHECK each,
    stretched by how much more work than cores the machine has (the 1-minute load average)."""
    busy = max(1.0, load / max(cpus, 1))
    return SECONDS_PER_CHECK * math.ceil(checks / max(shards, 1)) * busy


def _cache_dir() -> str:
    """Triton's cache for this check, kept between runs (keyed by each kernel's source, its
    options and Triton's version, so a hit is the same compile that passed before)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("TOKENMILL_COMPILE_CHECK_CACHE",
                          os.path.join(base, "tokenmill", "triton-compile-check"))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = _cache_dir()
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks" / "gpu"),
                                         str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    return env


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.mark.compile
@pytest.mark.slow
def test_kernels_compile_for_cuda() -> None:
    """The other tests run the interpreter, which accepts kernels the compiler rejects (a
    loop-carried value that changes type, for one)."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    # One process a core (a compile is single-threaded), sharing the cache directory.
    cpus = _cpus()
    shards = max(1, min(4, cpus))
    script = str(Path(__file__).with_name("triton_compile_jobs.py"))
    procs = [subprocess.Popen([sys.executable, script, str(i), str(shards)],
                              env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i in range(shards)]
    try:
        first = procs[0].stdout.readline()  # "checks N", once the jobs are built
        checks = int(first.split()[1]) if first.startswith("checks ") else 300
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        limit = float(os.environ.get("TOKENMILL_COMPILE_CHECK_TIMEOUT") or
                      check_limit_s(checks, shards, load, cpus))
        deadline = time.monotonic() + limit
        outputs, timed_out = [], False
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                timed_out = True
                p.kill()
                outputs.append(p.communicate())
    finally:
        for p in procs:
            p.kill()
    _report(outputs, [p.returncode for p in procs], timed_out, checks, limit, shards, load)


def _report(outputs: list[tuple[str, str]], codes: list[int | None], timed_out: bool,
            checks: int, limit: float, shards: int, load: float) -> None:
    """Fail with a few lines: the failing checks by name, or how far a slow run got."""
    lines = [line for out, _ in outputs for line in out.splitlines()]
    failed = [line for line in lines if line.startswith("FAILED ")]
    done = sum(line.startswith(("ok ", "FAILED ")) for line in lines)
    if failed:
        pytest.fail(f"{len(failed)} of {checks} CUDA compile checks failed:\n"
                    + "\n".join(failed[:20]), pytrace=False)
    if timed_out:
        pytest.fail(f"the CUDA compile check did not finish in {limit:.0f} s ({done} of "
                    f"{checks} checks done in {shards} processes, load {load:.1f}): a busy "
                    "machine? rerun it, or set TOKENMILL_COMPILE_CHECK_TIMEOUT (seconds)",
                    pytrace=False)
    for (out, err), code in zip(outputs, codes, strict=True):
        if code != 0 or "checks passed" not in out:  # it broke before its jobs (an import?)
            tail = "\n".join(err.strip().splitlines()[-12:])
            pytest.fail(f"a compile check process exited with {code}:\n{tail}", pytrace=False)
    assert done == checks, (done, checks)


def test_a_failing_check_is_one_line_and_the_rest_still_run() -> None:
    def broken() -> None:
        raise RuntimeError("PassManager::run failed\n" + "a page of MLIR\n" * 200)

    jobs = [("#0 good sm_80 aligned", lambda: None), ("#1 broken sm_90 aligned", broken),
            ("#2 good sm_90 aligned", lambda: None)]
    out = io.StringIO()
    assert run_shard(jobs, 0, 1, out) == 1
    assert out.getvalue().splitlines() == [
        "ok #0 good sm_80 aligned",
        "FAILED #1 broken sm_90 aligned: RuntimeError: PassManager::run failed",
        "ok #2 good sm_90 aligned",
        "shard 0/1: 2 of 3 checks passed (3 in all)"]
    # Shards split the jobs between them: every one runs once.
    outs = [io.StringIO(), io.StringIO()]
    assert [run_shard(jobs, i, 2, outs[i]) for i in range(2)] == [0, 1]
    ran = [line for o in outs for line in o.getvalue().splitlines() if line.startswith("ok ")]
    assert sorted(ran) == ["ok #0 good sm_80 aligned", "ok #2 good sm_90 aligned"]


def test_the_limit_scales_with_the_machine() -> None:
    idle = check_limit_s(207, 2, 0.5, 2)
    assert idle == SECONDS_PER_CHECK * 104
    assert check_limit_s(207, 4, 0.5, 4) < idle  # more processes, fewer checks each
    assert check_limit_s(207, 2, 8.0, 2) == 4 * idle  # four times the work the cores can do
