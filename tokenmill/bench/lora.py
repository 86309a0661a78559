"""`tokenmill bench lora`: what serving LoRA adapters costs, and transformers + PEFT beside it.

One process, one workload (random prompts of exact lengths, greedy, EOS ignored so every run
computes the same tokens), run in turn by:

- ``base``: an engine without LoRA;
- ``lora_on_base``: an engine with ``enable_lora``, requests without an adapter;
- ``one_adapter``: every request with the same adapter;
- ``mixed_adapters``: request ``i`` with adapter ``i % --num-adapters`` (``--max-loras`` slots);
- ``peft`` (unless ``--no-peft``): transformers' ``generate`` on the same GGUF file
  (dequantized to fp32) through PEFT's ``PeftModel`` with the first adapter, the workload as
  one left-padded batch.

The adapters are random (speed does not depend on their values), written as PEFT folders:
every projection at ``--rank``. Engine runs are alternated round by round so that a change in
the machine's load hits every mode; the median run of each is reported. Writes a JSON file
with the hardware, the command and the load average around the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokenmill.bench.datasets import random_requests
from tokenmill.bench.embed import timed
from tokenmill.bench.report import hardware, hardware_line, now_iso, write_json
from tokenmill.engine.llm import LLM
from tokenmill.lora.adapter import ATTENTION_MODULES, TARGET_MODULES, projection_shapes
from tokenmill.lora_request import LoRARequest
from tokenmill.model_loader.gguf import embedded_model_path
from tokenmill.models.config import ArchConfig
from tokenmill.sampling_params import SamplingParams

DEFAULT_OUTPUT = "benchmarks/results/lora-cpu.json"
ENGINE_MODES = ("base", "lora_on_base", "one_adapter", "mixed_adapters")


def add_lora_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench lora`."""
    p = subparsers.add_parser("lora", help="LoRA adapters: throughput with none, one and "
                                           "several, and transformers + PEFT")
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face folder (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--num-prompts", type=int, default=32, help="requests")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    p.add_argument("--num-adapters", type=int, default=4, help="adapters of the mixed mode")
    p.add_argument("--max-loras", type=int, default=4, help="the engine's adapter slots")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of each mode")
    p.add_argument("--peft", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers + PEFT (one run)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="where to write")
    p.set_defaults(func=cmd_lora)


def save_random_adapter(folder: Path, arch: ArchConfig, rank: int, seed: int) -> None:
    """A PEFT LoRA folder for ``arch``: every projection of every layer at ``rank``, random
    ``A`` and ``B`` of a trained adapter's scale."""
    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(arch)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for module in TARGET_MODULES:
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_features, out_features = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = 0.02 * torch.randn(rank, in_features,
                                                                    generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(out_features, rank,
                                                                    generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES), "bias": "none",
              "lora_dropout": 0.0, "base_model_name_or_path": None}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))


def cmd_lora(args: argparse.Namespace) -> int:
    """Run the benchmark, print a table, write the JSON."""
    torch.set_num_threads(args.threads)
    model = args.model or embedded_model_path()
    scratch = Path(tempfile.mkdtemp(prefix="tokenmill-lora-"))
    try:
        result = _run(args, model, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _print(result)
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return 0


def _run(args: argparse.Namespace, model: str, scratch: Path) -> dict[str, Any]:
    # No prefix caching: the warm-up and the other modes' runs would otherwise leave some
    # modes' prompts cached and not others'.
    options = dict(num_threads=args.threads, max_num_seqs=max(args.num_prompts, 1),
                   max_model_len=args.input_len + args.output_len + 16,
                   enable_prefix_caching=False)
    plain = LLM(model, **options)
    served = LLM(model, enable_lora=True, max_loras=args.max_loras,
                 max_lora_rank=max(args.rank, 16), **options)
    arch = served.engine.core.arch
    adapters = []
    for i in range(args.num_adapters):
        save_random_adapter(scratch / f"adapter{i}", arch, args.rank, seed=i)
        adapters.append(LoRARequest(f"adapter{i}", i + 1, str(scratch / f"adapter{i}")))
    requests = random_requests(served.engine.tokenizer, args.num_prompts, args.input_len,
                               args.output_len, seed=0)
    prompts = [served.engine.tokenizer.encode(r.prompt) for r in requests]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    runs_of = {
        "base": lambda: plain.generate(prompts, params, use_tqdm=False),
        "lora_on_base": lambda: served.generate(prompts, params, use_tqdm=False),
        "one_adapter": lambda: served.generate(prompts, params, use_tqdm=False,
                                               lora_request=adapters[0]),
        "mixed_adapters": lambda: served.generate(
            prompts, params, use_tqdm=False,
            lora_request=[adapters[i % len(adapters)] for i in range(len(prompts))]),
    }
    output_tokens = len(prompts) * args.output_len
    load_before = os.getloadavg()
    for run in runs_of.values():  # warm-up: slots filled, first-call allocations
        run()
    rates: dict[str, list[float]] = {mode: [] for mode in runs_of}
    for _ in range(args.repeats):
        for mode, run in runs_of.items():
            rates[mode].append(output_tokens / timed(run))
    plain.close()
    served.close()
    throughput: dict[str, Any] = {mode: {"output_tok_s": r, "median": statistics.median(r)}
                                  for mode, r in rates.items()}
    peft = _peft_rate(model, Path(adapters[0].lora_path), prompts, args.output_len) \
        if args.peft else None
    if peft is not None:
        throughput["peft"] = peft
    base = throughput["base"]["median"]
    for entry in throughput.values():
        entry["vs_base"] = entry["median"] / base
    return {
        "date": now_iso(), "command": "tokenmill " + " ".join(sys.argv[1:]),
        "hardware": hardware(), "threads": args.threads, "model": model,
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "rank": args.rank,
                     "num_adapters": args.num_adapters, "max_loras": args.max_loras,
                     "targets": list(TARGET_MODULES)},
        "throughput": throughput,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def _peft_rate(model: str, adapter: Path, prompts: list[list[int]],
               output_len: int) -> dict[str, Any] | None:
    """transformers + PEFT's output tokens/s on the workload as one batch (one run after a
    short warm-up), or None where a GGUF file is not what transformers loads here."""
    import transformers
    from peft import PeftModel

    if not model.endswith(".gguf"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    else:
        folder, name = os.path.split(os.path.abspath(model))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                               dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf.eval(), str(adapter))
    pad = hf.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(n: int) -> None:
        with torch.inference_mode():
            peft_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, pad_token_id=pad)

    run(2)
    seconds = timed(lambda: run(output_len))
    rate = len(prompts) * output_len / seconds
    return {"output_tok_s": [rate], "median": rate, "dtype": "float32",
            "transformers": transformers.__version__}


def _print(result: dict[str, Any]) -> None:
    w, t = result["workload"], result["throughput"]
    print(f"{w['num_prompts']} prompts x ({w['input_len']} in, {w['output_len']} out), greedy; "
          f"adapters of rank {w['rank']} on every projection; mixed: {w['num_adapters']} "
          f"adapters over {w['max_loras']} slots")
    print(f"{'mode':<18}{'median out tok/s':>18}{'vs base':>9}  runs")
    for mode in (*ENGINE_MODES, "peft"):
        if mode in t:
            runs = ", ".join(f"{x:.1f}" for x in t[mode]["output_tok_s"])
            print(f"{mode:<18}{t[mode]['median']:>18.1f}{t[mode]['vs_base']:>8.2f}x  {runs}")
    print(f"hardware: {hardware_line(result['hardware'])}; load average before/after: "
          f"{result['load_before']} / {result['load_after']}")
