"""Offline engine speed on the embedded model: single-stream decode, prefill, a batch of 32.

    python benchmarks/offline_speed.py --out benchmarks/results/offline-speed-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from tokenmill import LLM, SamplingParams


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="benchmarks/results/offline-speed-cpu.json")
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=2048, kv_cache_memory_bytes=512 << 20)
    decode = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8))  # warm-up

    t = timed(lambda: llm.generate("The capital of France is", decode))
    prompt = list(range(1000, 1500))
    one = SamplingParams(temperature=0, max_tokens=1)
    t_prefill = min(timed(lambda: llm.generate([prompt], one)) for _ in range(3))
    batch = [f"Tell me about topic number {i}." for i in range(32)]
    t_batch = timed(lambda: llm.generate(batch, decode, use_tqdm=False))
    rows = [
        ("single-stream decode, 128 tokens", 128 / t, "out tok/s"),
        ("prefill, 500-token prompt", 500 / t_prefill, "prompt tok/s"),
        ("batch of 32 x 128 output tokens", 32 * 128 / t_batch, "out tok/s"),
    ]
    for name, value, unit in rows:
        print(f"{name:<36} {value:>8.1f} {unit}")
    result = {
        "rows": [{"name": n, "value": v, "unit": u} for n, v, u in rows],
        "threads": torch.get_num_threads(),
        "dtype": str(llm.engine.core.dtype),
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
