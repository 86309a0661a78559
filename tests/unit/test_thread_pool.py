"""The C++ extension's thread pool (tokenmill/kernels/cpu/thread_pool.h), through its test hook
``parallel_iota`` and the kernels that use it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tokenmill.kernels.cpu import load_extension


@pytest.fixture(scope="module")
def ext():
    return load_extension()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n,grain", [(0, 1), (1, 1), (7, 1), (1000, 1), (1000, 999), (1000, 1000),
                                     (100_003, 7), (100_000, 64)])
def test_every_index_once(ext, two_threads, n, grain):
    out = ext.parallel_iota(n, grain)
    assert torch.equal(out, torch.arange(n))


def test_error_in_a_chunk_reaches_the_caller_and_the_pool_goes_on(ext, two_threads):
    for throw_at in (0, 5_000, 99_999):
        with pytest.raises(RuntimeError, match=f"index {throw_at} throws"):
            ext.parallel_iota(100_000, 16, throw_at)
        assert torch.equal(ext.parallel_iota(100_000, 16), torch.arange(100_000))
    with pytest.raises(RuntimeError, match="n must be >= 0"):
        ext.parallel_iota(-1)


def test_many_calls_in_a_row(ext, two_threads):
    # Back-to-back calls are what the workers spin for: none may be lost or run twice.
    for n in range(1, 3000):
        out = ext.parallel_iota(n % 97 + 2, 1)
        assert torch.equal(out, torch.arange(n % 97 + 2))


def test_other_thread_counts(ext):
    before = torch.get_num_threads()
    try:
        for threads in (1, 3, 2, 1):
            torch.set_num_threads(threads)
            assert torch.equal(ext.parallel_iota(10_000, 3), torch.arange(10_000))
    finally:
        torch.set_num_threads(before)


def test_calls_from_several_threads_at_once(ext, two_threads):
    # One call holds the workers; the others run on their own thread, all complete and correct.
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        try:
            for i in range(300):
                n = 1000 + (seed * 31 + i) % 500
                if not torch.equal(ext.parallel_iota(n, 1), torch.arange(n)):
                    raise AssertionError(f"thread {seed}: wrong result at n={n}")
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_kernel_results_do_not_depend_on_threads_or_spinning(tmp_path):
    # The int4 kernel over the pool: the same bits with one thread, two threads spinning, two
    # threads never spinning (TOKENMILL_SPIN_US=0), and on OpenMP's threads instead
    # (TOKENMILL_THREAD_POOL=0); each in its own process, as the pool reads its variables
    # when it starts.
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, torch\n"
        "from tokenmill.kernels.cpu import load_extension\n"
        "torch.set_num_threads(int(sys.argv[1]))\n"
        "g = torch.Generator().manual_seed(0)\n"
        "packed = torch.randint(0, 256, (64, 144, 32), dtype=torch.uint8, generator=g)\n"
        "scales = torch.randn(64, 18, 2, 16, generator=g).to(torch.bfloat16)\n"
        "x = torch.randn(37, 576, generator=g)\n"
        "y = load_extension().int4_q8_linear(x, packed, scales, 32, 16)\n"
        "torch.save(y, sys.argv[2])\n")
    results = []
    variants = [("1", "200", "1"), ("2", "200", "1"), ("2", "0", "1"), ("2", "200", "0")]
    for i, (threads, spin, pool) in enumerate(variants):
        out = tmp_path / f"y{i}.pt"
        env = {**os.environ, "TOKENMILL_SPIN_US": spin, "TOKENMILL_THREAD_POOL": pool}
        subprocess.run([sys.executable, str(script), threads, str(out)], env=env, check=True,
                       timeout=600)
        results.append(torch.load(out))
    for other in results[1:]:
        assert torch.equal(results[0], other)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pool_works_in_a_forked_child(ext, two_threads):
    ext.parallel_iota(10_000, 1)  # the parent's workers exist
    pid = os.fork()
    if pid == 0:  # child: the workers did not survive the fork; a new pool must serve it
        ok = torch.equal(ext.parallel_iota(10_000, 1), torch.arange(10_000))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert torch.equal(ext.parallel_iota(10_000, 1), torch.arange(10_000))


def test_stats_count_calls(ext, two_threads):
    before = ext.pool_stats()
    for _ in range(50):
        ext.parallel_iota(10_000, 1)
    after = ext.pool_stats()
    # Other threads of the test session may hold the workers for some of them (those run
    # inline and are not counted).
    assert after["calls"] > before["calls"]
    assert set(after) == {"calls", "caught_spinning", "woken", "backed_off", "spin_us"}


def test_spin_time_is_an_option(ext, two_threads):
    from tokenmill.kernels.cpu import set_kernel_spin_us

    default = ext.pool_stats()["spin_us"]
    try:
        set_kernel_spin_us(0)
        assert ext.pool_stats()["spin_us"] == 0
        ext.parallel_iota(10_000, 1)
        time.sleep(0.01)  # a worker still spinning from before sees the change at its next wait
        before = ext.pool_stats()
        for _ in range(50):
            assert torch.equal(ext.parallel_iota(10_000, 1), torch.arange(10_000))
        after = ext.pool_stats()
        assert after["caught_spinning"] == before["caught_spinning"]  # never spinning
        set_kernel_spin_us(None)  # leaves the setting as it is
        assert ext.pool_stats()["spin_us"] == 0
        with pytest.raises(ValueError, match="kernel_spin_us must be >= 0"):
            set_kernel_spin_us(-1)
        with pytest.raises(RuntimeError, match="must be >= 0 us"):
            ext.set_pool_spin_us(-5)
        # The refused values changed nothing, and the pool still serves calls.
        assert ext.pool_stats()["spin_us"] == 0
        assert torch.equal(ext.parallel_iota(10_000, 1), torch.arange(10_000))
    finally:
        set_kernel_spin_us(default)
    assert ext.pool_stats()["spin_us"] == default


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_workers_stop_spinning_on_a_contended_core(tmp_path):
    # Two threads on one core: a spinning worker takes the time slice the caller needs for its
    # own work between calls (0.5 ms of it, busy), and the kernel keeps one of them waiting
    # for the CPU. The worker sees that and sleeps instead. (A caller that sleeps between calls
    # leaves the core to the spinning worker: no contention, and on Linux 6.18 no back-off.)
    script = tmp_path / "run.py"
    script.write_text(
        "import os, time, torch\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "from tokenmill.kernels.cpu import load_extension\n"
        "torch.set_num_threads(2)\n"
        "ext = load_extension()\n"
        "for _ in range(1000):\n"
        "    assert torch.equal(ext.parallel_iota(20_000, 1), torch.arange(20_000))\n"
        "    end = time.perf_counter() + 0.0005\n"
        "    while time.perf_counter() < end:\n"
        "        pass\n"
        "print(ext.pool_stats()['backed_off'])\n")
    env = {**os.environ, "TOKENMILL_SPIN_US": "200", "TOKENMILL_THREAD_POOL": "1"}
    out = subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=600,
                         capture_output=True, text=True)
    assert int(out.stdout.split()[-1]) > 0


def test_engine_option_reaches_the_pool(ext):
    import argparse

    from tokenmill.config import DeviceConfig
    from tokenmill.engine.args import add_engine_args, engine_config_from_args
    from tokenmill.kernels.cpu import set_kernel_spin_us
    from tokenmill.runner.platform import Platform

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--kernel-spin-us", "150"]))
    assert config.device.kernel_spin_us == 150
    assert engine_config_from_args(parser.parse_args([])).device.kernel_spin_us is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="kernel_spin_us"):
            DeviceConfig(kernel_spin_us=bad)
    default = ext.pool_stats()["spin_us"]
    try:
        # What the executor does when it loads the model (executor/base.py, worker.py).
        Platform(torch.device("cpu")).set_kernel_spin_us(config.device.kernel_spin_us)
        assert ext.pool_stats()["spin_us"] == 150
        Platform(torch.device("cpu")).set_kernel_spin_us(None)
        assert ext.pool_stats()["spin_us"] == 150
    finally:
        set_kernel_spin_us(default)
