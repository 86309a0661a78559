"""`tokenmill bench gpu`: the CUDA backend's headline numbers, each next to its reference.

Suites (one per run, ``--suite``), on dummy weights of a preset shape by default:

- ``decode``: single-stream decode tokens/s against the memory-bandwidth roofline: every decode
  step reads the weights once, so tokens/s can be at most (device-to-device copy bandwidth,
  measured here) / (the bytes a step reads: every weight but the tables it reads one row of,
  an untied token embedding and the rotary positions). SGLang reports 158 tok/s for
  Llama-3.1-8B at batch 1 on an H100.
- ``throughput``: offline throughput, 1,000 requests of 1,000 prompt and 1,000 output tokens
  (TensorRT-LLM reports 15,220 output tok/s for Llama-3.1-8B on an H100 with fp8 weights).
- ``nano-vllm``: nano-vllm's workload: 256 requests, prompt and output lengths uniform in
  100..1024 (seed 0), on Qwen3-0.6B's shape.
- ``hf-batch``: the same offline workload through transformers' continuous batching
  (``generate_batch``) and through tokenmill, on the same random weights' shapes.

Every result records the GPU, driver, CUDA, torch and triton versions. The defaults reproduce
the issue's targets; ``benchmarks/gpu/run_all.sh`` runs them all. On a machine without a GPU
the same code runs on the CPU (tests do, at toy sizes).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from tokenmill.bench.datasets import SampleRequest, random_requests
from tokenmill.bench.latency import time_one
from tokenmill.bench.offline import engine_facts, load_engine, warm_up
from tokenmill.bench.report import command_line, hardware, now_iso, write_json
from tokenmill.bench.throughput import run_throughput
from tokenmill.engine.args import add_engine_args
from tokenmill.engine.llm_engine import LLMEngine

SUITES = ("decode", "throughput", "nano-vllm", "hf-batch")
# What each suite's number stands next to (from the issue and the peers' own reports).
REFERENCES: dict[str, dict[str, Any]] = {
    "decode": {"sglang_llama31_8b_h100_bs1_tok_s": 158.0, "target_roofline_fraction": 0.9},
    "throughput": {"tensorrt_llm_fp8_h100_out_tok_s": 15220.0,
                   "target_bf16_out_tok_s": 10000.0},
    "nano-vllm": {},
    "hf-batch": {"target_speedup": 5.0},
}
# Suite -> (model preset, number of requests, prompt length, output length) by default.
DEFAULTS: dict[str, tuple[str, int, str, str]] = {
    "decode": ("llama-3.1-8b", 3, "128", "512"),
    "throughput": ("llama-3.1-8b", 1000, "1000", "1000"),
    "nano-vllm": ("qwen3-0.6b", 256, "100:1024", "100:1024"),
    "hf-batch": ("llama-3.1-8b", 256, "1000", "1000"),
}


def device_facts(device: torch.device) -> dict[str, Any]:
    """GPU name, memory, compute capability, driver and the software versions."""
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    if device.type != "cuda":
        facts["device"] = "cpu"
        return facts
    props = torch.cuda.get_device_properties(device)
    facts.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                 compute_capability=f"{props.major}.{props.minor}",
                 multiprocessors=props.multi_processor_count)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
        facts["driver"] = out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError):
        facts["driver"] = None
    return facts


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once counts twice),
    the best of ``iters`` copies of ``nbytes``: the practical ceiling of a memory-bound kernel."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * nbytes / best


def run_decode(engine: LLMEngine, requests: list[SampleRequest], copy_bytes: int) -> dict[str, Any]:
    """Single-stream decode tokens/s (median of the requests) and its share of the roofline."""
    info = engine.model_info()
    bandwidth = copy_bandwidth(torch.device(info.device), copy_bytes)
    # What a decode step reads of the weights, each tensor once: not the untied token
    # embedding nor the rotary tables, of which it reads a row (runs before 2026-11-29 counted
    # them, 1.07 GB more for Llama-3.1-8B, and overstated the share by 7%).
    nbytes = info.decode_read_bytes
    roofline = bandwidth / nbytes
    timings = [time_one(engine, f"decode-{i}", req, 0.0) for i, req in enumerate(requests)]
    decode = statistics.median(t.decode_tps for t in timings if t.decode_tps is not None)
    return {"copy_bandwidth_gb_s": bandwidth / 1e9, "decode_read_bytes": nbytes,
            "weight_bytes": info.weight_bytes,
            "roofline_tokens_per_s": roofline, "decode_tokens_per_s": decode,
            "roofline_fraction": decode / roofline,
            "ttft_ms_median": statistics.median(t.ttft * 1000 for t in timings),
            "prompt_tokens": timings[0].prompt_tokens, "output_tokens": timings[0].output_tokens}


def hf_generate_batch(model_name: str, load_format: str, inputs: list[list[int]],
                      max_new: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """transformers' continuous batching on the prompts ``inputs``, ``max_new`` tokens each:
    random weights of the same shape (a preset) or the same Hugging Face folder; output
    tokens/s over the whole batch."""
    import transformers

    from tokenmill.presets import PRESETS

    if load_format == "dummy" and model_name in PRESETS:
        preset = dict(PRESETS[model_name])
        model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                      "Qwen2ForCausalLM": "qwen2"}[preset["architectures"][0]]
        config = transformers.AutoConfig.for_model(model_type, **preset)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype)
        model = model.to(device)
    model.eval()
    gen = transformers.GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs[:2], generation_config=gen, max_new_tokens=4)  # warm-up
    start = time.perf_counter()
    outputs = model.generate_batch(inputs, generation_config=gen)
    call_s = time.perf_counter() - start
    # From the requests' creation (after the call's own warm-up, graph captures included) to
    # the last one's end: the generation itself, as tokenmill's number is timed.
    elapsed = (max(o.lifespan[1] for o in outputs.values())
               - min(o.created_time for o in outputs.values()))
    out_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return {"peer": "transformers generate_batch", "version": transformers.__version__,
            "num_requests": len(outputs), "elapsed_s": elapsed, "call_s": call_s,
            "total_output_tokens": out_tokens, "output_tokens_per_s": out_tokens / elapsed}


def add_gpu_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench gpu`."""
    p = subparsers.add_parser("gpu", help="the CUDA backend's numbers against the roofline "
                              "and the peers' published ones", description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.set_defaults(model=None, load_format="dummy", max_num_seqs=256,
                   max_num_batched_tokens=8192)
    g = p.add_argument_group("suite")
    g.add_argument("--suite", choices=SUITES, required=True, help="which GPU benchmark to run")
    g.add_argument("--num-prompts", type=int, default=None, help="default: the suite's")
    g.add_argument("--input-len", default=None, help="N or MIN:MAX (default: the suite's)")
    g.add_argument("--output-len", default=None, help="N or MIN:MAX (default: the suite's)")
    g.add_argument("--copy-bytes", type=int, default=1 << 30,
                   help="size of the bandwidth-measuring copy (decode suite)")
    g.add_argument("--result-file", default=None, help="write the result JSON here")
    p.set_defaults(func=cmd_gpu)


def cmd_gpu(args: argparse.Namespace) -> int:
    """Run `tokenmill bench gpu`."""
    preset, num, input_len, output_len = DEFAULTS[args.suite]
    if args.model is None:
        args.model = preset
    num = args.num_prompts or num
    input_len = args.input_len or input_len
    output_len = args.output_len or output_len
    engine, load_s = load_engine(args)
    device = torch.device(engine.model_info().device)
    requests = random_requests(engine.tokenizer, num, input_len, output_len, args.seed)
    warm_up(engine, requests[0], 1)
    result: dict[str, Any] = {"suite": args.suite, "model": args.model,
                              "workload": {"num_requests": num, "input_len": input_len,
                                           "output_len": output_len, "seed": args.seed}}
    if args.suite == "decode":
        result["tokenmill"] = run_decode(engine, requests, args.copy_bytes)
        headline = (f"decode {result['tokenmill']['decode_tokens_per_s']:.1f} tok/s = "
                    f"{100 * result['tokenmill']['roofline_fraction']:.1f}% of the roofline "
                    f"({result['tokenmill']['roofline_tokens_per_s']:.1f} tok/s at "
                    f"{result['tokenmill']['copy_bandwidth_gb_s']:.0f} GB/s)")
    else:
        result["tokenmill"] = run_throughput(engine, requests, 0.0, progress=True)
        headline = f"{result['tokenmill']['output_tokens_per_s']:.1f} output tok/s"
        if args.suite == "hf-batch":
            result["engine"] = engine_facts(engine, load_s)
            # The peer computes in the engine's own dtype.
            dtype = getattr(torch, engine.model_info().dtype)
            inputs = [r.prompt if isinstance(r.prompt, list)
                      else engine.tokenizer.encode(r.prompt, add_special_tokens=False)
                      for r in requests]
            del engine  # give the GPU memory (weights, KV cache, graphs) to the peer
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            peer = hf_generate_batch(args.model, args.load_format, inputs,
                                     max(r.output_len for r in requests),
                                     dtype, device)
            result["peer"] = peer
            result["speedup"] = (result["tokenmill"]["output_tokens_per_s"]
                                 / peer["output_tokens_per_s"])
            headline += (f" vs {peer['output_tokens_per_s']:.1f} (transformers) = "
                         f"{result['speedup']:.2f}x")
    result.update(reference=REFERENCES[args.suite], device=device_facts(device),
                  hardware=hardware(), date=now_iso(),
                  command=command_line("tokenmill", sys.argv[1:]))
    if "engine" not in result:
        result["engine"] = engine_facts(engine, load_s)
    print(f"[{args.suite}] {args.model} on {result['device']['device']}: {headline}")
    if args.result_file:
        write_json(args.result_file, result)
    return 0

