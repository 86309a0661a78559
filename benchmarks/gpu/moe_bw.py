"""The fused-MoE Triton kernel (tokenmill/kernels/triton/fused_moe.py) alone, one MoE layer at a
time, against the grouped PyTorch path it replaces on CUDA (tokenmill/kernels/moe.py), on the
same inputs, outputs compared.

    python benchmarks/gpu/moe_bw.py [--tokens 1,8,32,256,2048] [--result-file FILE]

The layer is Qwen3-30B-A3B's (128 experts, top-8, hidden 2,048, expert width 768) in bf16,
and its experts in e4m3 with a scale a row (weight-only). The fused kernel is timed as the
engine's decode steps run it, replayed from a CUDA graph (its expert sort reads nothing back
to the host); the PyTorch path reads each expert's row count back to the host, so it cannot
be captured and is timed eagerly, launches included. Bytes a call moves: the weights of the
experts the step chose (each read once) and the activations; "share of copy" is that over
the GPU's copy bandwidth, the roofline of a decode step. Without a GPU it runs at toy sizes
in Triton's interpreter, to check the script, not to time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention_bw import copy_bandwidth  # noqa: E402

from tokenmill.bench.report import markdown_table, now_iso, write_json  # noqa: E402
from tokenmill.kernels.moe import torch_moe  # noqa: E402
from tokenmill.kernels.triton import fused_moe as fm  # noqa: E402

# (experts, top-k, hidden, expert width): the GPU's layer, and the interpreter's toy one.
GPU_LAYER = (128, 8, 2048, 768)
TOY_LAYER = (8, 2, 32, 16)
REPEATS = 20


def time_us(fn: Callable[[], Any], device: torch.device, graph: bool) -> float:
    """Median time of one call in microseconds (NaN off CUDA); ``graph``: replayed from a
    CUDA graph that captured one call."""
    if device.type != "cuda":
        return float("nan")
    fn()  # compile
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    times = []
    for _ in range(REPEATS):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def layer(shape: tuple[int, int, int, int], tokens: int, device: torch.device,
          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    experts, k, hidden, inter = shape
    gen = torch.Generator(device=device).manual_seed(tokens)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device=device) / inter ** 0.5
    x = torch.randn(tokens, hidden, generator=gen, device=device)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return dict(x=x.to(dtype), w13=w13.to(dtype), w2=w2.to(dtype),
                weights=weights / weights.sum(dim=-1, keepdim=True), ids=ids)


def bench(shape: tuple[int, int, int, int], tokens: int, device: torch.device,
          dtype: torch.dtype, bw: float, fp8: bool) -> dict[str, Any]:
    t = layer(shape, tokens, device, dtype)
    q13, s13 = fm.quantize_experts(t["w13"], torch.float8_e4m3fn)
    q2, s2 = fm.quantize_experts(t["w2"], torch.float8_e4m3fn)
    chosen = int(t["ids"].unique().numel())
    per_expert = t["w13"][0].numel() + t["w2"][0].numel()
    act_bytes = t["x"].numel() * t["x"].element_size() * 2
    row: dict[str, Any] = {"tokens": tokens, "experts_chosen": chosen}

    def fused() -> torch.Tensor:
        return fm.fused_moe(t["x"], t["w13"], t["w2"], t["weights"], t["ids"])

    def eager() -> torch.Tensor:
        return torch_moe(t["x"], t["w13"], t["w2"], t["weights"], t["ids"])

    def fused_fp8() -> torch.Tensor:
        return fm.fused_moe(t["x"], q13, q2, t["weights"], t["ids"], w13_scale=s13,
                            w2_scale=s2)

    want = eager().float()
    cases = [("fused", fused, True, t["x"].element_size()), ("pytorch", eager, False,
                                                              t["x"].element_size())]
    if fp8:
        cases.append(("fused_fp8", fused_fp8, True, 1))
    for name, fn, graph, weight_bytes in cases:
        got = fn().float()
        row[f"{name}_rel_err"] = ((got - want).norm() / want.norm()).item()
        us = time_us(fn, device, graph)
        row[f"{name}_us"] = us
        moved = chosen * per_expert * weight_bytes + act_bytes
        row[f"{name}_share_of_copy"] = moved / (us / 1e6) / bw
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    tokens_list = [int(n) for n in (a.tokens or ("1,8,32,256,2048" if gpu else "1,5")).split(",")]
    shape = GPU_LAYER if gpu else TOY_LAYER
    dtype = torch.bfloat16 if gpu else torch.float32  # the interpreter gets bf16 wrong
    fp8 = gpu and torch.cuda.get_device_capability() >= (8, 9)
    bw = copy_bandwidth(device)
    results = [bench(shape, n, device, dtype, bw, fp8) for n in tokens_list]
    names = ["fused", "pytorch"] + (["fused_fp8"] if fp8 else [])
    headers = ["tokens", "experts chosen"] + [f"{n} {c}" for n in names
                                             for c in ("us", "share of copy", "rel err")]
    print(markdown_table(headers, [[r["tokens"], r["experts_chosen"]]
                                   + [r[f"{n}_{c}"] for n in names
                                      for c in ("us", "share_of_copy", "rel_err")]
                                   for r in results]))
    name = torch.cuda.get_device_name(0) if gpu else "cpu (interpreter)"
    print(f"layer (experts, top-k, hidden, width) {shape}, {dtype}; copy bandwidth "
          f"{bw / 1e9:.0f} GB/s on {name}")
    if any(r["fused_rel_err"] > 2e-2 for r in results):
        raise SystemExit("the fused kernel's output differs from the PyTorch path's")
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "device": name,
                                   "torch": torch.__version__, "layer": list(shape),
                                   "copy_bandwidth_gb_s": bw / 1e9,
                                   "command": " ".join(["python", *sys.argv]),
                                   "results": results})


if __name__ == "__main__":
    main()
