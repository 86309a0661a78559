"""The Triton decode attention alone, against the memory roofline: for each (batch, context)
it reads every cached K and V once, B x L x Hkv x D x 2 x dtype bytes, so GB/s over the
device-to-device copy bandwidth is its efficiency. Sweeps the split kernel's launch settings
(partition, keys per tile, warps, pipelining stages) and checks each variant's output against
the default's, so the next GPU session can pick settings from one run.

    python benchmarks/gpu/attention_bw.py [--shapes 1x512,256x140,256x1500,64x4000]
        [--quick] [--result-file FILE]

Llama-3.1-8B's attention shape: 32 query heads over 8 KV heads of 128, bf16, 16-token blocks
placed in random order (as a long-running cache has them). Without a GPU it runs at toy sizes
in Triton's interpreter, to check the script, not to time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill.attention import triton_kernels as tk  # noqa: E402
from tokenmill.bench.report import markdown_table, now_iso, write_json  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16


def make_case(batch: int, ctx: int, device: torch.device, dtype: torch.dtype,
              gen: torch.Generator) -> dict[str, Any]:
    """A cache holding ``batch`` sequences of ``ctx`` tokens in shuffled blocks, and queries."""
    per_seq = -(-ctx // BLOCK)
    num_blocks = batch * per_seq + 1
    cache = torch.randn(2, num_blocks, BLOCK, HKV, D, generator=gen, device=device,
                        dtype=torch.float32).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device)
    tables = perm.view(batch, per_seq).to(torch.int32).contiguous()
    q = torch.randn(batch, HQ, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return {"q": q, "cache": cache, "tables": tables, "lens": lens, "max_len": ctx,
            "kv_bytes": batch * ctx * HKV * D * 2 * cache.element_size()}


def run(case: dict[str, Any], **settings: Any) -> torch.Tensor:
    return tk.decode_attention(case["q"], case["cache"], case["tables"], case["lens"],
                               D ** -0.5, case["max_len"], **settings)


def time_ms(fn: Any, device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_ms(lambda: dst.copy_(src), device) / 1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="BATCHxCONTEXT,... (default by device)")
    ap.add_argument("--quick", action="store_true", help="the default settings only")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = a.shapes or ("1x512,256x140,256x1500,64x4000" if device.type == "cuda"
                          else "2x40,3x70")
    cases = [tuple(int(v) for v in s.split("x")) for s in shapes.split(",")]
    default = {"partition_size": 512, "block_n": tk._DECODE_BLOCK_N,
               "num_warps": tk.NUM_WARPS, "num_stages": None}
    # Every partition x tile x warps at Triton's default pipelining, then the default with
    # each depth: 21 compiles, about a minute on a GPU for four shapes.
    variants = [default] + ([] if a.quick else [
        {"partition_size": p, "block_n": n, "num_warps": w, "num_stages": None}
        for p, n, w in itertools.product((256, 512, 1024), (16, 32, 64), (4, 8))
    ] + [dict(default, num_stages=st) for st in (1, 2, 3)])
    if device.type != "cuda":
        variants = variants[:3]
    bw = copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows, results = [], []
    for batch, ctx in cases:
        case = make_case(batch, ctx, device, dtype, gen)
        ref = run(case, **default).float()
        for v in variants:
            try:
                out = run(case, **v).float()
                err = ((out - ref).norm() / ref.norm()).item()
                ms = time_ms(lambda v=v, c=case: run(c, **v), device)
            except Exception as e:  # a setting the compiler rejects (registers, shared memory)
                results.append({"batch": batch, "context": ctx, **v, "error": str(e)[:200]})
                continue
            gbs = case["kv_bytes"] / (ms / 1000) / 1e9
            results.append({"batch": batch, "context": ctx, **v, "ms": ms, "gb_s": gbs,
                            "share_of_copy": gbs * 1e9 / bw, "rel_err_vs_default": err})
        timed = [r for r in results[-len(variants):] if "ms" in r]
        base = timed[0]
        best = min(timed, key=lambda r: r["ms"]) if device.type == "cuda" else base
        rows.append([f"{batch}x{ctx}", case["kv_bytes"] / 1e9, base["ms"], base["gb_s"],
                     best["ms"], best["gb_s"],
                     ", ".join(f"{k}={best[k]}" for k in default)])
    print(markdown_table(["batch x context", "KV GB", "default ms", "default GB/s", "best ms",
                          "best GB/s", "best settings"], rows))
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s on "
          f"{torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu (interpreter)'}")
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "copy_bandwidth_gb_s": bw / 1e9,
                                   "device": (torch.cuda.get_device_name(0)
                                              if device.type == "cuda" else "cpu"),
                                   "torch": torch.__version__,
                                   "command": " ".join(["python", *sys.argv]),
                                   "results": results})


if __name__ == "__main__":
    main()
