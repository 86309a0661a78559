"""Rank 0's side of tensor parallelism: start the workers, send them each step, stop them.

The engine process is rank 0: it keeps the scheduler and runs its own shard in its own
ModelRunner. :class:`TPExecutor` spawns ranks 1..tp-1 (``tokenmill.executor.worker``),
joins the process groups with them, agrees on the KV cache size, and broadcasts every step
before running it. Workers never outlive the engine: ``close()``, garbage collection of the
executor and interpreter exit all send the shutdown message (and kill what does not stop),
and a worker that dies turns into a :class:`WorkerDiedError` at the next step.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.distributed.parallel_state import (
    all_reduce_min,
    broadcast_object,
    destroy_distributed,
    in_tp_group,
    init_distributed,
)
from tokenmill.executor.base import Executor
from tokenmill.executor.worker import (
    DIST_PREFIX,
    STORE_HOST,
    StepMessage,
    WorkerArgs,
    error_key,
    run_worker,
    stage_key,
)
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.platform import Platform

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Seconds a worker gets to exit after the shutdown message before it is killed.
JOIN_TIMEOUT_S = 10.0
# After a failed collective, how long to wait for the worker that caused it to show as dead.
DEATH_GRACE_S = 2.0
_POLL_S = 0.02


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process ended (or failed) while the engine needed it."""


def check_parallel_config(config: EngineConfig, device: torch.device) -> None:
    """ValueError naming the field when ``config`` cannot run tensor-parallel on ``device``."""
    tp = config.parallel.tensor_parallel_size
    if tp == 1:
        return
    if config.speculative.method == "draft":
        raise ValueError("speculative_model (a draft model) is not supported with "
                         f"tensor_parallel_size={tp}; use speculative='ngram' or one rank")
    if device.type == "cuda":
        first = device.index or 0
        count = torch.cuda.device_count()
        if first + tp > count:
            raise ValueError(f"tensor_parallel_size={tp} needs GPUs cuda:{first}..cuda:"
                             f"{first + tp - 1}, but {count} are visible")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of ``rank``: the CPU for every rank, or the ``rank``-th GPU from ``device``."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def cpu_threads_per_rank(num_threads: int | None, tp: int) -> int | None:
    """Threads each rank uses: ``num_threads`` if set, else the cores shared among the ranks."""
    if num_threads is not None or tp == 1:
        return num_threads
    return max(1, len(os.sched_getaffinity(0)) // tp)


@dataclass
class _Workers:
    """The worker processes and what stopping them needs; kept apart from TPExecutor so that
    its finalizer holds no reference to the executor."""

    procs: list[mp.Process]
    store: dist.TCPStore
    joined: bool = False  # rank 0 joined the process groups (and must leave them)
    serving: bool = False  # the workers wait in their step loop for broadcasts
    errors: dict[int, str] = field(default_factory=dict)

    def failure(self) -> str | None:
        """Why a worker is gone or failing, or None while all are well."""
        for rank, proc in enumerate(self.procs, start=1):
            key = error_key(rank)
            if rank not in self.errors and self.store.check([key]):
                self.errors[rank] = self.store.get(key).decode()
            if rank in self.errors or (proc.pid is not None and not proc.is_alive()):
                why = self.errors.get(rank, "see its log above")
                return f"tensor-parallel worker rank {rank} failed (exit code {proc.exitcode}): {why}"
        return None

    def stop(self) -> None:
        """Shut the workers down (kill those that do not stop) and leave the groups."""
        if self.serving and self.failure() is None:
            self.serving = False
            try:
                broadcast_object(None)
            except Exception as e:  # a worker died meanwhile; the kill below covers it
                logger.debug("shutdown broadcast failed: %s", e)
            for proc in self.procs:
                if proc.pid is not None:
                    proc.join(JOIN_TIMEOUT_S)
        for proc in self.procs:
            if proc.pid is None:  # never started
                continue
            if proc.is_alive():
                proc.kill()
            proc.join(JOIN_TIMEOUT_S)
        if self.joined:
            self.joined = False
            destroy_distributed()


class TPExecutor(Executor):
    """Starts ranks 1..tp-1 and sends them each step; rank 0's runner is this process's."""

    def __init__(self, config: EngineConfig, platform: Platform,
                 num_threads: int | None) -> None:
        """Spawn the workers and join the process groups with them (this process is rank 0
        on ``platform``'s device); they load their shards while this process loads its own
        (:meth:`load_model`)."""
        if in_tp_group():
            raise RuntimeError("this process already runs a tensor-parallel engine; close it "
                               "first (one per process)")
        parallel = config.parallel
        super().__init__(config, platform, num_threads, parallel.tensor_parallel_size)
        self.timeout = timedelta(seconds=parallel.timeout_s)
        device = platform.device
        store = dist.TCPStore(STORE_HOST, 0, self.num_ranks, is_master=True,
                              timeout=self.timeout, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=run_worker, name=f"tokenmill-tp-rank{rank}", daemon=True,
                             args=(WorkerArgs(rank, config, store.port,
                                              str(rank_device(device, rank)), num_threads),))
                 for rank in range(1, self.num_ranks)]
        self._workers = _Workers(procs, store)
        self._finalizer = weakref.finalize(self, self._workers.stop)
        self._last_sampled: dict[str, list[int]] = {}
        try:
            for proc in procs:
                proc.start()
            self._wait_for("joined")
            init_distributed(0, self.num_ranks, dist.PrefixStore(DIST_PREFIX, store), device,
                             self.timeout)
            self._workers.joined = True
        except BaseException:
            self.close()
            raise

    @property
    def processes(self) -> list[mp.Process]:
        """The worker processes, rank 1 first."""
        return list(self._workers.procs)

    def wait_until_loaded(self) -> None:
        """Return once every worker has loaded its shard (fails fast if one died)."""
        self._wait_for("loaded")

    def min_free_memory(self, local_free: int) -> int:
        """The least of ``local_free`` over the ranks (each rank's free memory, or on CUDA
        what gpu_memory_utilization leaves it), once every worker has its shard."""
        self._wait_for("loaded")
        return self._guard(all_reduce_min, local_free)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Give every rank a KV cache of ``num_blocks`` blocks (of its own KV heads); the
        workers then capture their CUDA graphs, as rank 0 does next."""
        self._guard(broadcast_object, num_blocks)
        self._workers.serving = True
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, sched: SchedulerOutput,
                draft_probs: dict[str, torch.Tensor]) -> RunnerOutput:
        """Send the step to the workers, then run rank 0's share of it."""
        self._raise_if_failed()
        msg = StepMessage(sched, draft_probs, self._last_sampled)
        out = self._guard(self._broadcast_and_run, self.runner, msg)
        self._last_sampled = out.sampled_token_ids
        return out

    def close(self) -> None:
        """Stop the workers; idempotent. The engine cannot step afterwards."""
        self._finalizer()

    @staticmethod
    def _broadcast_and_run(runner: ModelRunner, msg: StepMessage) -> RunnerOutput:
        # Compiled grammars do not pickle, and the workers need none: rank 0's samples are
        # the ones every rank adopts (see worker.adopt_sampled_tokens).
        grammars = [(new, new.grammar) for new in msg.sched.new_requests if new.grammar]
        for new, _ in grammars:
            new.grammar = None
        try:
            broadcast_object(msg)
        finally:
            for new, grammar in grammars:
                new.grammar = grammar
        return runner.execute(msg.sched, msg.draft_probs)

    def _guard(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``; a collective that fails because a worker died says so."""
        try:
            return fn(*args)
        except RuntimeError as e:
            deadline = time.monotonic() + DEATH_GRACE_S
            while time.monotonic() < deadline:
                why = self._workers.failure()
                if why is not None:
                    raise WorkerDiedError(why) from e
                time.sleep(_POLL_S)
            raise

    def _raise_if_failed(self) -> None:
        why = self._workers.failure()
        if why is not None:
            raise WorkerDiedError(why)

    def _wait_for(self, stage: str) -> None:
        """Wait until every worker reached ``stage``, failing fast if one dies."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        pending = set(range(1, self.num_ranks))
        while pending:
            pending = {r for r in pending if not self._workers.store.check([stage_key(stage, r)])}
            self._raise_if_failed()
            if pending and time.monotonic() > deadline:
                raise WorkerDiedError(f"tensor-parallel workers {sorted(pending)} did not reach "
                                      f"{stage!r} within {self.timeout.total_seconds():.0f} s")
            time.sleep(_POLL_S if pending else 0)
