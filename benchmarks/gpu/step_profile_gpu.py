"""Where a CUDA decode step's time goes, at several batch sizes: the steps timed as a run
(host clock around ``--steps`` calls of ``engine.step()``, the device synchronized before and
after the run only, so that asynchronous scheduling overlaps them as it does in service), then
profiled with torch.profiler (CPU and CUDA activity). The GPU kernels are grouped (matmuls,
attention, norms/rotary/activations, sampling, copies); "GPU busy" is the sum of kernel
times per step, and the step time minus it is where the GPU waits on the host (scheduling,
input building, output processing, launch gaps).

    python benchmarks/gpu/step_profile_gpu.py --model llama-3.1-8b --batches 1,256 \
        [--steps 20] [--prompt-tokens 128] [--quantization fp8] [--kv-cache-dtype fp8]
        [--prefill] [--result-file FILE]

With ``--prefill`` it profiles full prefill chunks instead (``--max-num-batched-tokens``
prompt tokens a step), with the linear layers' matmul rate.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM
from tokenmill.bench.latency import start_decoding
from tokenmill.bench.report import command_line, markdown_table, now_iso, write_json

PROMPT_TOKENS = 128
ACTIVITIES = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
# Kernel name fragments -> group (first match wins): the rotary embedding of q and k, done in
# the K/V store's kernel (_rotary_store_kv_kernel), counts as attention. With TOKENMILL_PDL a
# kernel starts before the one before it ends and waits for it on the GPU: its time includes
# that wait, so the groups add up to more than the step and "GPU idle" reads low; the step
# time (the host's clock over a run of steps) is what to compare.
GROUPS = [
    # TOKENMILL_L2_PREFETCH's reads, on a side stream beside the other kernels: their time
    # overlaps the rest, so with them on the busy time overstates and the idle understates.
    ("L2 prefetch (side stream)", ("_touch_kernel",)),
    ("fp8 activation quantization", ("quantize",)),
    ("matmul (cuBLAS/cutlass GEMM)", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitk",
                                       "matmul", "_mm")),
    ("attention (Triton)", ("attention", "attn", "_decode_split", "_decode_reduce", "_prefill",
                            "paged", "store_kv")),
    ("fused norms / rotary / activations", ("rms", "norm", "rotary", "rope", "silu", "swiglu",
                                             "fused")),
    ("sampling", ("greedy", "sort", "topk", "argmax", "softmax", "multinomial", "exponential", "cumsum",
                  "reduce")),
    ("copies, indexing, elementwise", ("copy", "index", "gather", "scatter", "fill", "elementwise",
                                       "cat", "memcpy", "memset")),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other kernels"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_steps(llm: LLM, batch: int, steps: int, seed: int, prof: bool,
              prompt_tokens: int = PROMPT_TOKENS) -> tuple[float, Any]:
    """(seconds a step, over a run of ``steps``; the profile of as many more).

    The clock starts with one step already launched: with asynchronous scheduling each timed
    call then launches a step and waits for the one before, as in a long run, and the first
    launch (scheduled while the device is idle) is not spread over the timed steps. Before
    2026-11-28 (night) the run started from an idle device and ended with a synchronize,
    which added the first step's host work / ``steps`` to every step (about 0.5 ms in 10
    steps at batch 256): the "GPU idle" of the earlier profiles includes it.
    """
    engine = llm.engine
    start_decoding(engine, batch, prompt_tokens, 2 * steps + 9, seed)
    return timed_steps(engine, steps, prof)


def timed_steps(engine: Any, steps: int, prof: bool) -> tuple[float, Any]:
    """(seconds a step over a run of ``steps``, the profile of as many more or None), the
    clock started with one step already launched (see :func:`run_steps`); then the engine's
    requests are run to the end."""
    sync()
    engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - t) / steps
    sync()
    p = None
    if prof:
        with profile(activities=ACTIVITIES) as p:
            for _ in range(steps):
                engine.step()
            sync()
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, p


def run_prefill_steps(llm: LLM, prompt_tokens: int, steps: int, seed: int
                      ) -> tuple[float, int, Any]:
    """(seconds a prefill step, prompt tokens a step, the profile of ``steps`` more): enough
    prompts of ``prompt_tokens`` (one output token each) that every timed step is a full
    chunk of ``max_num_batched_tokens`` prompt tokens, after two untimed ones."""
    from tokenmill.sampling_params import SamplingParams

    engine = llm.engine
    budget = engine.core.scheduler.config.max_num_batched_tokens
    prompts = -(-(2 * steps + 3) * budget // prompt_tokens)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i in range(prompts):
        ids = torch.randint(100, vocab - 100, (prompt_tokens,), generator=gen).tolist()
        engine.add_request(f"prefill{seed}-{i}", {"prompt_token_ids": ids}, params)
    engine.step()  # (the second untimed step is timed_steps')
    seconds, p = timed_steps(engine, steps, prof=True)
    return seconds, budget, p


def linear_params(model: torch.nn.Module) -> int:
    """Weights of the layers' linear products (not the head, which a prefill step runs for
    its finished prompts' last rows only): 2 x this x tokens is a step's matmul FLOPs."""
    return sum(m.in_features * m.out_features for name, m in model.named_modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features")
               and name.split(".")[-1] != "lm_head")


def kernel_groups(p: Any, steps: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """(ms per step by group, top kernels) from the profile's device-side events."""
    groups: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for evt in p.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = evt.time_range.elapsed_us() / 1000 / steps
        groups[group_of(evt.name)] = groups.get(group_of(evt.name), 0.0) + ms
        kernels[evt.name] = kernels.get(evt.name, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return groups, top


def step_report(step_ms: float, p: Any, steps: int) -> dict[str, Any]:
    """A profiled step's kernel groups (with the GPU's idle time), busy time and top
    kernels."""
    groups, top = kernel_groups(p, steps)
    busy = sum(groups.values())
    rows = sorted(groups.items(), key=lambda kv: -kv[1])
    rows.append(("GPU idle (host work, launch gaps)", max(step_ms - busy, 0.0)))
    return {"step_ms": step_ms, "gpu_busy_ms": busy, "groups_ms": dict(rows),
            "top_kernels": top}


def print_report(headline: str, report: dict[str, Any]) -> None:
    step_ms = report["step_ms"]
    print(f"\n{headline}, GPU busy {report['gpu_busy_ms']:.2f} ms")
    print(markdown_table(["where", "ms per step", "share"],
                         [[g, ms, f"{ms / step_ms:.0%}"]
                          for g, ms in report["groups_ms"].items()]))
    print(markdown_table(["kernel", "ms per step"],
                         [[k[:70], ms] for k, ms in report["top_kernels"]]))


def profile_prefill(llm: LLM, prompt_tokens: int, steps: int) -> dict[str, Any]:
    """A prefill step's time, its groups of kernels, and the matmuls' rate (printed too)."""
    seconds, tokens, p = run_prefill_steps(llm, prompt_tokens, steps, seed=0)
    step_ms = seconds * 1000
    report = step_report(step_ms, p, steps)
    flops = 2 * linear_params(llm.engine.core.executor.runner.model) * tokens
    matmul_ms = next((ms for g, ms in report["groups_ms"].items() if g.startswith("matmul")),
                     0.0)
    tflops = flops / (matmul_ms / 1000) / 1e12 if matmul_ms else None
    print_report(f"prefill: step {step_ms:.2f} ms for {tokens} prompt tokens "
                 f"({tokens / step_ms * 1000:.0f} tok/s), matmuls "
                 + (f"{tflops:.0f} TFLOP/s" if tflops else "not timed"), report)
    return {**report, "prompt_tokens_per_step": tokens,
            "tokens_per_s": tokens / step_ms * 1000, "matmul_tflops": tflops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                    help="each sequence's context before the timed steps (the throughput "
                         "workload decodes at 1,000-2,000)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="chunked prefill's budget a step, as `bench gpu` runs the workloads")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--prefill", action="store_true",
                    help="profile prefill steps instead: full chunks of "
                         "--max-num-batched-tokens prompt tokens, prompts of --prompt-tokens "
                         "(where the 1,000 x 1,000 runs spend their time between waves)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    llm = LLM(model=a.model, load_format="dummy", device=a.device, max_model_len=a.max_model_len,
              max_num_seqs=max(batches), quantization=a.quantization,
              max_num_batched_tokens=a.max_num_batched_tokens,
              kv_cache_dtype=a.kv_cache_dtype)
    results: dict[str, Any] = {}
    if a.prefill:
        results["prefill"] = profile_prefill(llm, a.prompt_tokens, a.steps)
        batches = []
    for n, batch in enumerate(batches):
        run_steps(llm, batch, 3, seed=100 + n, prof=False,  # warm-up at this batch size
                  prompt_tokens=a.prompt_tokens)
        seconds, p = run_steps(llm, batch, a.steps, seed=n, prof=True,
                               prompt_tokens=a.prompt_tokens)
        step_ms = seconds * 1000
        report = step_report(step_ms, p, a.steps)
        results[str(batch)] = {**report, "tokens_per_s": batch / step_ms * 1000}
        print_report(f"batch {batch}: step {step_ms:.2f} ms (a run of {a.steps}), "
                     f"{batch / step_ms * 1000:.1f} tok/s", report)
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "model": a.model, "prefill": a.prefill,
                                   "prompt_tokens": a.prompt_tokens,
                                   "quantization": a.quantization,
                                   "kv_cache_dtype": a.kv_cache_dtype,
                                   "device": (torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"),
                                   "torch": torch.__version__,
                                   "command": command_line("python", sys.argv),
                                   "results": results})


if __name__ == "__main__":
    main()
