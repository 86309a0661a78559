"""A tensor-parallel worker: ranks 1..tp-1, each a process the engine (rank 0) spawned.

A worker loads its shard of the model with the engine's ModelConfig, builds a ModelRunner,
takes its KV cache size from rank 0, then runs every step rank 0 broadcasts until it is told
to stop. It keeps no scheduler: rank 0's SchedulerOutput says what to compute, so every rank
keeps the same requests, blocks and tokens.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.distributed.parallel_state import (
    all_reduce_min,
    broadcast_object,
    destroy_distributed,
    init_distributed,
)
from tokenmill.executor.base import load_runner
from tokenmill.runner.kv_memory import profiled_kv_budget
from tokenmill.runner.model_runner import ModelRunner, capture_decode_graphs_if_enabled
from tokenmill.runner.platform import get_platform

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
# Prefix of torch.distributed's own keys in the store, apart from the start-up keys below.
DIST_PREFIX = "dist"
# How often a worker checks that the engine process is still there.
PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process is started with (pickled by the spawn context)."""

    rank: int
    config: EngineConfig
    store_port: int
    device: str
    num_threads: int | None


@dataclass
class StepMessage:
    """One engine step, as rank 0 broadcasts it to the workers."""

    sched: SchedulerOutput
    # Distributions of draft-model drafts per request (see ModelRunner.execute).
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    # The tokens rank 0 sampled in the previous step, per request: the workers replace theirs
    # with these before running this step, so every rank continues from the same tokens even
    # where sampling is random (each process has its own RNG) or logits differ in the last bit.
    last_sampled: dict[str, list[int]] = field(default_factory=dict)


def stage_key(stage: str, rank: int) -> str:
    """Store key a worker sets when it reaches a start-up ``stage`` ("joined", "loaded")."""
    return f"{stage}/{rank}"


def error_key(rank: int) -> str:
    """Store key holding the error a worker died of."""
    return f"error/{rank}"


def run_worker(args: WorkerArgs) -> None:
    """Entry point of a worker process; returns when rank 0 sends the shutdown message."""
    _exit_with_parent()
    parallel = args.config.parallel
    timeout = timedelta(seconds=parallel.timeout_s)
    store = dist.TCPStore(STORE_HOST, args.store_port, parallel.tensor_parallel_size,
                          is_master=False, timeout=timeout)
    try:
        _serve(args, store, timeout)
    except BaseException as e:
        try:
            store.set(error_key(args.rank), f"{type(e).__name__}: {e}")
        except Exception:  # the engine is gone: nobody to tell
            pass
        raise
    finally:
        destroy_distributed()


def _serve(args: WorkerArgs, store: dist.Store, timeout: timedelta) -> None:
    config = args.config
    platform = get_platform(args.device)
    if platform.is_cuda:
        torch.cuda.set_device(platform.device)
    platform.set_num_threads(args.num_threads)
    platform.set_kernel_spin_us(config.device.kernel_spin_us)
    store.set(stage_key("joined", args.rank), "1")
    init_distributed(args.rank, config.parallel.tensor_parallel_size,
                     dist.PrefixStore(DIST_PREFIX, store), platform.device, timeout)
    loaded, runner = load_runner(config, platform)
    store.set(stage_key("loaded", args.rank), "1")
    # The same sizing and capture steps as rank 0's executor, at the same points: their forward
    # passes (profiling, graph warm-up and capture) meet rank 0's in the all-reduces.
    max_model_len = config.model.max_model_len or loaded.arch.max_position_embeddings
    budget = profiled_kv_budget(runner, config, max_model_len)
    all_reduce_min(budget if budget is not None else platform.available_memory())
    num_blocks = broadcast_object()
    assert isinstance(num_blocks, int)
    runner.allocate_kv_cache(num_blocks)
    capture_decode_graphs_if_enabled(runner, config, max_model_len)
    step_loop(runner)


def step_loop(runner: ModelRunner) -> None:
    """Run each step rank 0 broadcasts until the shutdown message (None)."""
    own: dict[str, list[int]] = {}
    while True:
        msg = broadcast_object()
        if msg is None:
            return
        assert isinstance(msg, StepMessage)
        adopt_sampled_tokens(runner, own, msg.last_sampled)
        own = runner.execute(msg.sched, msg.draft_probs).sampled_token_ids


def adopt_sampled_tokens(runner: ModelRunner, own: dict[str, list[int]],
                         authoritative: dict[str, list[int]]) -> None:
    """Replace the tokens this rank appended last step (``own``) with rank 0's.

    The runner appends what it samples to its copy of each request, and the next step reads
    its input tokens from there; rank 0's sample is the one the engine reports, so it must be
    the one every rank continues from (reaches into the runner's request states, which only
    the runner's own sampling otherwise writes).
    """
    for rid, tokens in authoritative.items():
        mine = own.get(rid, [])
        state = runner.requests.get(rid)
        if state is None or mine == tokens:
            continue
        del state.token_ids[len(state.token_ids) - len(mine):]
        state.token_ids.extend(tokens)


def _exit_with_parent() -> None:
    """End this process when the engine process goes away, however it goes.

    Daemon processes are only stopped by a parent that exits normally; a killed engine would
    leave the worker blocked in a collective. (PR_SET_PDEATHSIG is no help: it fires when the
    spawning *thread* ends, and engines are built in threads that end.)
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="tokenmill-parent-watch", daemon=True).start()
