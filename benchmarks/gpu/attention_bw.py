"""The Triton decode attention alone, against the memory roofline: for each (batch, context)
it reads every cached K and V once, B x L x Hkv x D x 2 x dtype bytes, so GB/s over the
device-to-device copy bandwidth is its efficiency. Sweeps the split kernel's launch settings
(partition, keys per tile, warps, pipelining stages, where the block ids are read) and checks
each variant's output against the default's, so the next GPU session can pick settings from
one run.

    python benchmarks/gpu/attention_bw.py [--shapes 1x512,1x2000,256x140,256x1500,64x4000]
        [--max-seq-len-bound 4096] [--quick] [--context-split N] [--result-file FILE]
        [--write-tuning FILE]

With ``--write-tuning`` it writes the fastest settings of small batches (<= 8 sequences) and of
the rest as a decode tuning file, which the engine reads for this GPU model from
``tokenmill/kernels/tuning/attention/`` (see tokenmill/kernels/tuning/decode_attention.py). With
``--context-split N`` each batch class is two, contexts up to N tokens and longer ones, each
with its own rule (``max_context``); the shorter class is timed with a grid for N tokens, as
its CUDA graph launches it (one partition of N or more: no reduction).

Llama-3.1-8B's attention shape: 32 query heads over 8 KV heads of 128, bf16, 16-token blocks
placed in random order (as a long-running cache has them). Without a GPU it runs at toy sizes
in Triton's interpreter, to check the script, not to time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill.bench.report import markdown_table, now_iso, write_json  # noqa: E402
from tokenmill.kernels.triton import attention_decode as triton_decode  # noqa: E402
from tokenmill.kernels.tuning.decode_attention import DEFAULT_LAUNCH, FP8_COMPUTE  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16
DEFAULT = DEFAULT_LAUNCH.kwargs()
# Batches up to this size form the "small" class (one rule of the tuning file), the rest "large".
SMALL_BATCH = 8
# A variant whose output differs more than this from the default's (relative norm) is not picked.
MAX_REL_ERR = 2e-2
# Timing (time_ms): calls per measurement, measurements, and the spin that covers queuing them
# (~20 ms at 2 GHz, against ~100 us a call to queue from Python).
CALLS, REPEATS, SPIN_CYCLES = 64, 5, 40_000_000


def make_case(batch: int, ctx: int, bound: int, device: torch.device, dtype: torch.dtype,
              gen: torch.Generator, kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A cache holding ``batch`` sequences of ``ctx`` tokens in shuffled blocks, and queries."""
    per_seq = -(-ctx // BLOCK)
    num_blocks = batch * per_seq + 1
    cache = torch.randn(2, num_blocks, BLOCK, HKV, D, generator=gen, device=device,
                        dtype=torch.float32).to(kv_dtype or dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device)
    tables = perm.view(batch, per_seq).to(torch.int32).contiguous()
    q = torch.randn(batch, HQ, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return {"q": q, "cache": cache, "tables": tables, "lens": lens, "max_len": bound,
            "kv_bytes": batch * ctx * HKV * D * 2 * cache.element_size()}


def run(case: dict[str, Any], **settings: Any) -> torch.Tensor:
    return triton_decode.decode_attention(case["q"], case["cache"], case["tables"], case["lens"],
                               D ** -0.5, case["max_len"], **settings)


def time_ms(fns: list[Callable[[], Any]], device: torch.device) -> float:
    """Median GPU time of one call, the calls rotating over ``fns`` back to back.

    A spin kernel keeps the GPU busy while the calls are queued, so Python's launch cost is
    not in the figure: one sequence's kernels take a few microseconds, less than a launch from
    Python, and the first sweep (triton's do_bench, 2026-11-27) timed launches for them, not
    kernels. The engine replays decode steps from CUDA graphs, where launches cost ~nothing.
    ``fns`` over separate caches stand for the model's layers: a small cache read again and
    again would come from L2, which no decode step sees.
    """
    if device.type != "cuda":
        return float("nan")
    for fn in fns:  # compile and warm up
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        for i in range(CALLS):
            fns[i % len(fns)]()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_ms([lambda: dst.copy_(src)], device) / 1000)


def grid_bound(ctx: int, bound: int, context_split: int | None) -> int:
    """The context bound a decode step of ``ctx`` tokens sizes its grid for: the engine's
    (``bound``, as a CUDA graph launches it), or the context class's when contexts are split
    and ``ctx`` is in the shorter class (its graph serves no longer context)."""
    if context_split is not None and ctx <= context_split:
        return min(max(ctx, bound), context_split)
    return max(ctx, bound)


def sweep(cases: list[tuple[int, int]], variants: list[dict[str, Any]], bound: int,
          device: torch.device, dtype: torch.dtype, bw: float,
          kv_dtype: torch.dtype | None = None,
          context_split: int | None = None) -> list[dict[str, Any]]:
    """Time every variant on every (batch, context); each result names its case and settings."""
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for batch, ctx in cases:
        limit = grid_bound(ctx, bound, context_split)
        group = [make_case(batch, ctx, limit, device, dtype, gen, kv_dtype)]
        # Enough separate caches (up to 32, as many layers) to hold ~1 GB: out of L2.
        copies = max(1, min(32, int(1e9 // group[0]["kv_bytes"])))
        if device.type == "cuda":
            group += [make_case(batch, ctx, limit, device, dtype, gen, kv_dtype)
                      for _ in range(copies - 1)]
        case = group[0]
        ref = run(case, **DEFAULT).float()
        for v in variants:
            try:
                out = run(case, **v).float()
                err = ((out - ref).norm() / ref.norm()).item()
                ms = time_ms([lambda v=v, c=c: run(c, **v) for c in group], device)
            except Exception as e:  # a setting the compiler rejects (registers, shared memory)
                results.append({"batch": batch, "context": ctx, **v, "error": str(e)[:200]})
                continue
            gbs = case["kv_bytes"] / (ms / 1000) / 1e9
            results.append({"batch": batch, "context": ctx, "grid_bound": limit, **v,
                            "ms": ms, "gb_s": gbs,
                            "share_of_copy": gbs * 1e9 / bw, "rel_err_vs_default": err})
        timed = [r for r in results[-len(variants):] if "ms" in r]
        if timed:  # progress, so that a run cut short still says something
            best = min(timed, key=lambda r: r["ms"])
            print(f"{batch}x{ctx}: {len(timed)} of {len(variants)} timed; fastest "
                  f"{best['ms'] * 1000:.1f} us ({best['share_of_copy']:.0%} of the copy rate) "
                  f"with " + ", ".join(f"{k}={best[k]}" for k in DEFAULT), flush=True)
    return results


def best_variant(results: list[dict[str, Any]], shapes: set[tuple[int, int]],
                 variants: list[dict[str, Any]]) -> tuple[dict[str, Any], float] | None:
    """The variant with the least total time over ``shapes`` (each timed, output within
    MAX_REL_ERR of the default's), and that total; None if none qualifies."""
    totals = []
    for v in variants:
        rows = [r for r in results if (r["batch"], r["context"]) in shapes
                and all(r[k] == v[k] for k in DEFAULT)]
        if len(rows) == len(shapes) and all("ms" in r and r["rel_err_vs_default"] <= MAX_REL_ERR
                                            for r in rows):
            totals.append((sum(r["ms"] for r in rows), v))
    if not totals:
        return None
    total, v = min(totals, key=lambda t: t[0])
    return v, total


def tuning_rules(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured classes' rules as a tuning file's list: the last becomes the rule for any
    step (a class left unmeasured takes its neighbour's settings), and a context class whose
    settings equal the next rule's is folded into it."""
    out = [dict(r) for r in rules]
    out[-1]["max_batch"] = None
    out[-1].pop("max_context", None)
    launch = [k for k in DEFAULT]
    return [r for i, r in enumerate(out)
            if i + 1 == len(out) or "max_context" not in r
            or any(r[k] != out[i + 1][k] for k in launch)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="BATCHxCONTEXT,... (default by device)")
    ap.add_argument("--max-seq-len-bound", type=int, default=4096,
                    help="the grid's bound on context lengths, as a CUDA graph launches it "
                         "(the engine's max model length)")
    ap.add_argument("--quick", action="store_true", help="the default settings only")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                    help="the cache's dtype: the queries' (auto) or fp8 e4m3, as the engine's "
                         "--kv-cache-dtype; an fp8 sweep's --write-tuning adds by_batch_fp8 "
                         "to the file")
    for flag, what in (("--partitions", "partition sizes"), ("--block-ns", "keys per tile"),
                       ("--warps", "warps"), ("--stages", "pipelining depths ('default')"),
                       ("--fp8-computes", "widenings of an fp8 cache (fp16, query)"),
                       ("--max-registers", "registers a thread ('default': the compiler's)"),
                       ("--preload-tables", "block-id reads (0: a tile's in the loop, 1: the "
                                            "partition's before it)")):
        ap.add_argument(flag, default=None, help=f"comma-separated {what} to sweep")
    ap.add_argument("--context-split", type=int, default=None, metavar="N",
                    help="contexts up to N tokens and longer ones get a rule each, in both "
                         "batch classes")
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--write-tuning", default=None, metavar="FILE",
                    help="write the fastest settings per batch class as a decode tuning file "
                         "(tokenmill/kernels/tuning/decode_attention.py)")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = a.shapes or ("1x512,1x2000,256x140,256x1500,64x4000" if device.type == "cuda"
                          else "1x40,3x70")
    cases = [tuple(int(v) for v in s.split("x")) for s in shapes.split(",")]
    bound = a.max_seq_len_bound if device.type == "cuda" else 0
    # Every partition x tile x warps at Triton's default pipelining: 30 compiles, then each
    # batch class's fastest at every pipelining depth. An fp8 cache moves half the bytes a
    # tile, so its grid has longer tiles, and both widenings (fp16, the queries' bf16).
    # --partitions/--block-ns/--warps/--stages/--fp8-computes replace a dimension's values
    # (a narrower sweep around an earlier winner).
    fp8 = a.kv_cache_dtype == "fp8"
    dims = {"partition_size": (256, 512, 1024) if fp8 else (64, 128, 256, 512, 1024),
            "block_n": (32, 64, 128) if fp8 else (16, 32, 64), "num_warps": (4, 8),
            "num_stages": (None,),
            "fp8_compute": FP8_COMPUTE if fp8 else (DEFAULT["fp8_compute"],),
            "max_registers": (None,), "preload_table": (False,)}
    for key, given in (("partition_size", a.partitions), ("block_n", a.block_ns),
                       ("num_warps", a.warps), ("num_stages", a.stages),
                       ("fp8_compute", a.fp8_computes), ("max_registers", a.max_registers),
                       ("preload_table", a.preload_tables)):
        if given:
            dims[key] = tuple(None if x == "default" else x if key == "fp8_compute"
                              else bool(int(x)) if key == "preload_table" else int(x)
                              for x in given.split(","))
    grid = [DEFAULT] + ([] if a.quick else [
        v for v in (dict(zip(dims, point, strict=True)) for point in itertools.product(*dims.values()))
        if v != DEFAULT])
    if device.type != "cuda":  # the interpreter: check the script, not the settings
        grid = [DEFAULT, dict(DEFAULT, partition_size=16, block_n=16, num_warps=4),
                dict(DEFAULT, partition_size=32, block_n=16, num_stages=3, preload_table=True)]
    bw = copy_bandwidth(device)
    kv_dtype = torch.float8_e4m3fn if a.kv_cache_dtype == "fp8" else None
    results = sweep(cases, grid, bound, device, dtype, bw, kv_dtype, a.context_split)
    # Batch classes, each split by context with --context-split: (shapes, the rule's
    # bounds); the last class's rule is for any step.
    classes = {}
    for size, shapes_of, bounds in (
            ("small", {c for c in cases if c[0] <= SMALL_BATCH}, {"max_batch": SMALL_BATCH}),
            ("large", {c for c in cases if c[0] > SMALL_BATCH}, {})):
        if a.context_split:
            split = a.context_split
            classes[f"{size}, contexts <= {split}"] = (
                {c for c in shapes_of if c[1] <= split}, dict(bounds, max_context=split))
            classes[f"{size}, contexts > {split}"] = (
                {c for c in shapes_of if c[1] > split}, bounds)
        else:
            classes[size] = (shapes_of, bounds)
    staged = []
    for shapes_of, _ in classes.values():
        found = best_variant(results, shapes_of, grid) if shapes_of else None
        if found and not a.quick and not a.stages:
            # Pipelining depths, with the tiles' block ids read in the loop and before it
            # (which is what lets depths above 2 keep copies in flight).
            staged += [v for v in (dict(found[0], num_stages=st, preload_table=pre)
                                   for st in (1, 2, 3, 4) for pre in (False, True))
                       if v not in grid + staged]
    if staged:
        results += sweep(cases, staged, bound, device, dtype, bw, kv_dtype, a.context_split)
    variants = grid + staged

    rows = []
    for batch, ctx in cases:
        mine = [r for r in results if (r["batch"], r["context"]) == (batch, ctx) and "ms" in r]
        base = next(r for r in mine if all(r[k] == DEFAULT[k] for k in DEFAULT))
        best = min(mine, key=lambda r: r["ms"])
        rows.append([f"{batch}x{ctx}", mine[0]["gb_s"] * mine[0]["ms"] / 1000, base["ms"],
                     base["gb_s"], best["ms"], best["gb_s"],
                     ", ".join(f"{k}={best[k]}" for k in DEFAULT)])
    print(markdown_table(["batch x context", "KV GB", "default ms", "default GB/s", "best ms",
                          "best GB/s", "best settings"], rows))
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (interpreter)"
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s on {name}")
    command = " ".join(["python", *sys.argv])
    rules = []
    for cls, (shapes_of, bounds) in classes.items():
        found = best_variant(results, shapes_of, variants) if shapes_of else None
        if found is None:
            continue
        v, total = found
        base_total = best_variant(results, shapes_of, [DEFAULT])
        rules.append({"max_batch": None, **bounds, **v,
                      "shapes": sorted(f"{b}x{c}" for b, c in shapes_of),
                      "total_ms": total,
                      "default_total_ms": base_total[1] if base_total else None})
        print(f"{cls} ({', '.join(rules[-1]['shapes'])}): "
              + ", ".join(f"{k}={v[k]}" for k in DEFAULT)
              + f"; {total:.3f} ms against the default's {rules[-1]['default_total_ms']}")
    if a.write_tuning:
        if not rules:
            raise SystemExit("no launch setting was timed on every shape: no tuning written")
        by_batch = tuning_rules(rules)
        if a.kv_cache_dtype == "fp8":
            # The fp8 cache's rules join the file's others (by_batch, for bf16 caches).
            if not os.path.isfile(a.write_tuning):
                raise SystemExit(f"{a.write_tuning}: an fp8 sweep adds its rules to an "
                                 "existing tuning file; write the bf16 one first")
            with open(a.write_tuning) as f:
                data = json.load(f)
            data.update({"by_batch_fp8": by_batch, "created_fp8": now_iso(),
                         "command_fp8": command})
        else:
            data = {"device": name, "created": now_iso(), "command": command,
                    "torch": torch.__version__, "by_batch": by_batch}
        write_json(a.write_tuning, data)
        print(f"wrote {a.write_tuning}")
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "copy_bandwidth_gb_s": bw / 1e9,
                                   "device": name, "torch": torch.__version__,
                                   "command": command, "max_seq_len_bound": bound,
                                   "tuning": rules, "results": results})


if __name__ == "__main__":
    main()
