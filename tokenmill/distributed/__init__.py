"""Tensor parallelism over the processes of one machine: process groups and collectives
(``parallel_state``) and the executor that runs the worker ranks (``executor``, ``worker``)."""

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
