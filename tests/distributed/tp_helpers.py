"""Test helper: run sharded models in two gloo processes and send their results back.

The functions here run in processes spawned by the tests (``torch.multiprocessing``), which
import this module by name: the spawn context hands them the test process's ``sys.path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hf_checkpoints import load_ours
from paged import PagedKVCache, run_step

from tokenmill.distributed import destroy_distributed, init_distributed, tp_size
from tokenmill.models.parallel import VocabParallelEmbedding, copy_rank_slice
from tokenmill.quant import quantize_model

TIMEOUT = timedelta(seconds=60)
# Two sequences: a prefill of one and then a mixed step (decode of it, prefill of another).
PROMPT_A = [5, 9, 33, 100, 7, 250, 18, 4, 61, 3, 77, 200]
PROMPT_B = [40, 41, 42, 43, 44, 45, 46]


@dataclass(frozen=True)
class ShardJob:
    """One model to load sharded from ``folder``, quantized with ``method`` or not."""

    folder: str
    method: str = "none"


def two_step_logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits of every token of two steps through a paged cache of this rank's KV heads."""
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, model.num_kv_heads, c.head_dim)
    first = run_step(model, cache, [(0, PROMPT_A)])
    second = run_step(model, cache, [(0, [11]), (1, PROMPT_B)])
    return torch.cat(first + second)


def padded_vocab_check() -> tuple[torch.Tensor, torch.Tensor]:
    """(lookup, logits) of a 7-row vocabulary split in padded shards, for ids 0..6; equal to
    ``W[ids]`` and ``h @ W.T`` when the shards are right."""
    from tokenmill.distributed import tensor_model_parallel_all_gather

    weight = torch.randn(7, 4, generator=torch.Generator().manual_seed(3))
    emb = VocabParallelEmbedding(7, 4)
    with torch.no_grad():
        copy_rank_slice(emb.weight, weight, 0)
        ids = torch.arange(7)
        rows = emb(ids)
        logits = tensor_model_parallel_all_gather(F.linear(rows, emb.weight))[:, :7]
    return rows, logits


def shard_worker(rank: int, world: int, port: int, jobs: list[ShardJob],
                 results: mp.Queue) -> None:
    """Rank ``rank``: join the group, run every job, and (rank 0) put the results."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
    init_distributed(rank, world, store, torch.device("cpu"), TIMEOUT)
    try:
        assert tp_size() == world
        out: list[torch.Tensor] = []
        for job in jobs:
            model, _ = load_ours(Path(job.folder))
            if job.method != "none":
                quantize_model(model, job.method)
            out.append(two_step_logits(model))
        out.extend(padded_vocab_check())
        if rank == 0:  # numpy: shared-memory tensors would need this process alive
            results.put([t.numpy() for t in out])
    finally:
        destroy_distributed()


def run_sharded(jobs: list[ShardJob], world: int = 2) -> list[torch.Tensor]:
    """Run ``jobs`` on ``world`` spawned ranks; rank 0's logits per job, then the padded
    vocabulary's lookup and logits."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=TIMEOUT,
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=shard_worker, args=(r, world, store.port, jobs, results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = [torch.from_numpy(a) for a in results.get(timeout=TIMEOUT.total_seconds())]
    finally:
        for p in procs:
            p.join(TIMEOUT.total_seconds())
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return out
