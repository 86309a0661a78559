"""Tensor parallelism over the processes of one machine: process groups and the collectives
the sharded model calls (``parallel_state``). The processes themselves are started and fed
by ``tokenmill.executor``."""

from tokenmill.distributed.parallel_state import (
    all_reduce_min,
    broadcast_object,
    destroy_distributed,
    in_tp_group,
    init_distributed,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tp_rank,
    tp_size,
    unsharded,
)

__all__ = [
    "all_reduce_min",
    "broadcast_object",
    "destroy_distributed",
    "in_tp_group",
    "init_distributed",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tp_rank",
    "tp_size",
    "unsharded",
]
