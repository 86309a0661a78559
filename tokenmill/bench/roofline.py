"""The memory roofline of single-stream decode on the CPU, as `bench compare` measures it.

A decode step of one sequence reads every weight once, so tokens/s can be at most (memory read
bandwidth) / (weight bytes per token). The bandwidth is measured here, on this machine and this
thread count: the best of a few reductions over a buffer far larger than the caches. The bytes
are the model file's own: every tensor but an untied token embedding (a step reads one row of
it). tokenmill keeps GGUF's Q4_1 / Q8_0 blocks at the same size (4-bit values with a bf16 scale
and zero per 32 weights; int8 with a scale per row), so one number serves every system.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from tokenmill.model_loader.gguf_split import read_gguf

BUFFER_BYTES = 1 << 30
REPEATS = 5


def read_bandwidth(threads: int, nbytes: int = BUFFER_BYTES, repeats: int = REPEATS) -> float:
    """Bytes per second one pass over a large fp32 buffer reads at ``threads`` threads (best of
    ``repeats`` passes, after one to make it resident)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4)
        buf.sum()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return buf.numel() * 4 / best
    finally:
        torch.set_num_threads(previous)


def decode_weight_bytes(gguf_path: str) -> int:
    """Bytes of weights one decode step reads: every tensor of the file, except the token
    embedding when the model has a separate output head."""
    tensors = read_gguf(gguf_path).tensors  # every shard of a split model
    names = {t.name for t in tensors}
    skip = {"token_embd.weight"} if "output.weight" in names else set()
    return sum(int(t.data.nbytes) for t in tensors if t.name not in skip)


def roofline(gguf_path: str, threads: int) -> dict[str, Any]:
    """The bandwidth, the bytes per token and the tokens/s they allow; with more than one
    thread, also what one thread reads. On a shared VM the threads' total moves with the
    neighbours (a 2-core Zen 5 read 42-49 GB/s on some runs and 74-82 on others, one thread
    ~39 on both): the pair says which of the two a run had."""
    bandwidth = read_bandwidth(threads)
    nbytes = decode_weight_bytes(gguf_path)
    out = {"read_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes_per_token": nbytes,
           "roofline_tokens_per_s": bandwidth / nbytes, "threads": threads,
           "buffer_bytes": BUFFER_BYTES}
    if threads > 1:
        out["read_bandwidth_1_thread_gb_s"] = read_bandwidth(1) / 1e9
    return out


def fraction(decode_tokens_per_s: Any, result: dict[str, Any]) -> float | None:
    """A decode speed as a share of ``result``'s roofline (None when either is missing)."""
    limit = result.get("roofline_tokens_per_s") if result else None
    if not isinstance(decode_tokens_per_s, int | float) or not limit:
        return None
    return decode_tokens_per_s / limit


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenmill.bench.roofline --model F --threads N``: the roofline as one JSON
    line. `bench compare` runs it as its own process, so that the 1 GiB buffer never counts in
    the memory of the processes it starts after it."""
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.roofline",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--threads", type=int, required=True)
    args = p.parse_args(argv)
    print(json.dumps(roofline(args.model, args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
