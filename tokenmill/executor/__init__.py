"""How the engine runs its model: one interface (:class:`Executor`), a one-process
implementation (``local``) and tensor parallelism over processes (``tensor_parallel``, with
the worker ranks in ``worker``). :func:`make_executor` picks the one a configuration asks for.
The types its methods take and return are exported here, so the engine needs no import of
the runner's modules.
"""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor, ExecutorInfo, WeightTallies
from tokenmill.executor.local import LocalExecutor
from tokenmill.executor.tensor_parallel import (
    TPExecutor,
    WorkerDiedError,
    check_parallel_config,
    cpu_threads_per_rank,
    rank_device,
)
from tokenmill.runner.kv_memory import KVCachePlan
from tokenmill.runner.launched import LaunchedStep
from tokenmill.runner.platform import Platform, get_platform

__all__ = ["Executor", "ExecutorInfo", "KVCachePlan", "LaunchedStep", "LocalExecutor",
           "TPExecutor", "WeightTallies", "WorkerDiedError", "make_executor"]


def make_executor(config: EngineConfig, preloaded: bool = False) -> Executor:
    """The executor ``config`` asks for, before any model is loaded: a LocalExecutor for one
    rank, else a TPExecutor whose workers start loading their shards at once.

    ``preloaded``: the engine brings a model already in memory, which cannot be sharded.
    ValueError naming the field when the configuration cannot run.
    """
    platform = get_platform(config.device.device)
    tp = config.parallel.tensor_parallel_size
    check_parallel_config(config, platform.device)
    if tp > 1 and preloaded:
        raise ValueError("a model loaded beforehand cannot be sharded: give config.model "
                         f"with tensor_parallel_size={tp}")
    num_threads = cpu_threads_per_rank(config.device.num_threads, tp)
    if tp == 1:
        return LocalExecutor(config, platform, num_threads)
    platform = Platform(rank_device(platform.device, 0))
    if platform.is_cuda:
        torch.cuda.set_device(platform.device)
    return TPExecutor(config, platform, num_threads)
