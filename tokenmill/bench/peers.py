"""Single-stream and batch measurements of the peers (llama.cpp, transformers), run as a script.

`tokenmill bench compare` runs this file with the peers' own Python (the virtual environment
that benchmarks/setup_peers.sh makes), so it imports nothing from tokenmill: only the standard
library, the peer and torch. It prints progress to stderr and one JSON object on stdout's last
line. The definitions match `tokenmill bench latency`: TTFT from the call to the first token,
prefill tokens/s = prompt tokens / TTFT, decode tokens/s = (output tokens - 1) / (e2e - TTFT).

    python peers.py check
    python peers.py llama-latency --model M.gguf --threads 2 --workload latency.jsonl
    python peers.py hf-latency    --model M.gguf --threads 2 --workload latency.jsonl
    python peers.py hf-batch      --model M.gguf --threads 2 --workload batch.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# One request: prompt token ids and output length -> (ttft, e2e, output tokens), in seconds.
TimeOne = Callable[[list[int], int], tuple[float, float, int]]


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def read_workload(path: str) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per line of a JSONL workload."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.append((list(row["prompt_token_ids"]), int(row["output_len"])))
    return rows


def check() -> dict[str, Any]:
    """Versions of the peers this Python can import (None where missing)."""
    out: dict[str, Any] = {}
    for name in ("llama_cpp", "transformers", "torch"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            out[name] = None
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"
    return out


def latency_loop(time_one: TimeOne, rows: list[tuple[list[int], int]],
                 warmups: int) -> dict[str, Any]:
    """Warm up on the first rows, time the rest one at a time, report medians."""
    for ids, n in rows[:warmups]:
        time_one(ids, min(n, 8))
    iters = []
    for ids, n in rows[warmups:]:
        ttft, e2e, n_out = time_one(ids, n)
        iters.append({"prompt_tokens": len(ids), "output_tokens": n_out, "ttft": ttft, "e2e": e2e})
        log(f"prompt {len(ids)} tok, {n_out} out: ttft {ttft * 1000:.1f} ms, e2e {e2e:.2f} s")
    decode = [(i["output_tokens"] - 1) / (i["e2e"] - i["ttft"]) for i in iters
              if i["output_tokens"] > 1 and i["e2e"] > i["ttft"]]
    return {
        "prompt_tokens": iters[0]["prompt_tokens"], "output_tokens": iters[0]["output_tokens"],
        "ttft_ms": {"median": statistics.median(i["ttft"] * 1000 for i in iters)},
        "e2e_ms": {"median": statistics.median(i["e2e"] * 1000 for i in iters)},
        "prefill_tokens_per_s": statistics.median(i["prompt_tokens"] / i["ttft"] for i in iters),
        "decode_tokens_per_s": statistics.median(decode) if decode else None,
        "iterations": iters,
    }


def llama_latency(args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp through llama-cpp-python's `Llama` API, greedy, EOS not checked."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads,
                          n_threads_batch=args.threads, n_batch=512, verbose=False)

    def time_one(ids: list[int], n: int) -> tuple[float, float, int]:
        llm.reset()  # forget the previous prompt: no prefix reuse across iterations
        start = time.perf_counter()
        first = last = 0.0
        count = 0
        # generate() yields every sampled token and never stops at EOS by itself.
        for _ in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.0, reset=True):
            last = time.perf_counter()
            first = first or last
            count += 1
            if count >= n:
                break
        return first - start, last - start, count

    out = latency_loop(time_one, read_workload(args.workload), args.num_warmups)
    out.update(peer="llama.cpp", version=llama_cpp.__version__, threads=args.threads,
               peak_rss_mib=peak_rss_mib())
    return out


def load_hf(args: argparse.Namespace) -> Any:
    """transformers' model from the same GGUF file (dequantized to fp32)."""
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    folder, name = os.path.split(os.path.abspath(args.model))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                              dtype=torch.float32)
    return model.eval()


def hf_latency(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' `generate`, one sequence, greedy, with EOS suppressed by min_new_tokens."""
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    model = load_hf(args)

    class Clock(BaseStreamer):
        """generate() calls put() once with the prompt, then once per new token."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def time_one(ids: list[int], n: int) -> tuple[float, float, int]:
        clock = Clock()
        x = torch.tensor([ids])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, streamer=clock,
                           pad_token_id=model.config.eos_token_id)
        tokens = clock.times[1:]
        return tokens[0] - start, tokens[-1] - start, len(tokens)

    out = latency_loop(time_one, read_workload(args.workload), args.num_warmups)
    out.update(peer="transformers", version=transformers.__version__, threads=args.threads,
               peak_rss_mib=peak_rss_mib())
    return out


def hf_batch(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' `generate` on the whole workload as one batch (left-padded if needed)."""
    import torch
    import transformers

    model = load_hf(args)
    rows = read_workload(args.workload)
    n_out = max(n for _, n in rows)
    width = max(len(ids) for ids, _ in rows)
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    x = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in rows])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in rows])

    def run(max_new: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(x, attention_mask=mask, max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, pad_token_id=pad)
        return time.perf_counter() - start

    for _ in range(args.num_warmups):
        run(4)
    elapsed = run(n_out)
    tokens = len(rows) * n_out
    log(f"batch {len(rows)} x {n_out}: {elapsed:.2f} s, {tokens / elapsed:.1f} out tok/s")
    return {"peer": "transformers", "version": transformers.__version__, "threads": args.threads,
            "batch_size": len(rows), "output_tokens_each": n_out, "elapsed_s": elapsed,
            "total_input_tokens": sum(len(ids) for ids, _ in rows),
            "total_output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "peak_rss_mib": peak_rss_mib()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["check", "llama-latency", "hf-latency", "hf-batch"])
    ap.add_argument("--model", default=None, help="the GGUF file")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads (default: every core this process may use)")
    ap.add_argument("--workload", default=None, help="JSONL of prompt_token_ids, output_len")
    ap.add_argument("--num-warmups", type=int, default=1, help="untimed iterations first")
    ap.add_argument("--n-ctx", type=int, default=2048)
    args = ap.parse_args(argv)
    commands: dict[str, Callable[[], dict[str, Any]]] = {
        "check": check, "llama-latency": lambda: llama_latency(args),
        "hf-latency": lambda: hf_latency(args), "hf-batch": lambda: hf_batch(args)}
    print(json.dumps(commands[args.command]()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
