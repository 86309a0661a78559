"""`tokenmill bench beam`: beam search throughput, against the other ways to run it.

One workload (random prompts of exact lengths, ``--beam-width`` beams, EOS ignored so every
run computes the same tokens: each beam runs to ``--output-len``), run by:

- ``engine_beams``: tokenmill's beam search in the scheduler (beams share KV blocks);
- ``request_per_step``: vLLM's way (its ``LLM.beam_search``) on the same engine: each step,
  every live beam is a new one-token request carrying its whole sequence, served from the
  prefix cache, and the beams are chosen outside the engine;
- ``n_samples``: ``n = beam width`` greedy samples with as many top logprobs (the same rows
  per step and the same sampling path, without beam search: what its bookkeeping costs);
- ``transformers`` (unless ``--no-transformers``): ``generate(num_beams=...)`` on the same
  GGUF file (dequantized to fp32), the prompts as one left-padded batch.

The rate is beam tokens per second: prompts x beam width x output length, over the run's
time. Engine modes alternate round by round (the median run is reported) so that a change
in the machine's load hits all of them. Writes a JSON file with the hardware and command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

from tokenmill.bench.datasets import random_requests
from tokenmill.bench.embed import timed
from tokenmill.bench.report import hardware, hardware_line, now_iso, write_json
from tokenmill.engine.llm import LLM
from tokenmill.model_loader.gguf import embedded_model_path
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_OUTPUT = "benchmarks/results/beam-cpu.json"
ENGINE_MODES = ("engine_beams", "request_per_step", "n_samples")


def add_beam_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench beam`."""
    p = subparsers.add_parser("beam", help="beam search: the engine's, one request per beam "
                                           "and step (vLLM's way), n samples, transformers")
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face folder (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts")
    p.add_argument("--beam-width", type=int, default=4, help="beams per prompt")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens per beam")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of each mode")
    p.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers' beam search (one run)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="where to write")
    p.set_defaults(func=cmd_beam)


def cmd_beam(args: argparse.Namespace) -> int:
    """Run the benchmark, print a table, write the JSON."""
    if 2 * args.beam_width > MAX_LOGPROBS:
        raise SystemExit(f"--beam-width must be at most {MAX_LOGPROBS // 2} (the one-request-"
                         f"per-step mode asks for 2 x width logprobs)")
    torch.set_num_threads(args.threads)
    result = _run(args, args.model or embedded_model_path())
    _print(result)
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return 0


def _run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    width = args.beam_width
    llm = LLM(model, num_threads=args.threads, max_num_seqs=args.num_prompts * width,
              max_model_len=args.input_len + args.output_len + 16)
    tok = llm.engine.tokenizer
    requests = random_requests(tok, args.num_prompts, args.input_len, args.output_len, seed=0)
    prompts = [tok.encode(r.prompt) for r in requests]
    beams = SamplingParams(n=width, use_beam_search=True, max_tokens=args.output_len,
                           ignore_eos=True)
    # Greedy, so that its rows take the same sampling path as the beams' (argmax and top
    # logprobs): the difference is the beam search's own work.
    samples = SamplingParams(n=width, temperature=0.0, max_tokens=args.output_len,
                             ignore_eos=True, logprobs=min(2 * width, MAX_LOGPROBS))
    runs_of = {
        "engine_beams": lambda: llm.generate(prompts, beams, use_tqdm=False),
        "request_per_step": lambda: request_per_step(llm, prompts, width, args.output_len),
        "n_samples": lambda: llm.generate(prompts, samples, use_tqdm=False),
    }
    beam_tokens = len(prompts) * width * args.output_len
    load_before = os.getloadavg()
    for run in runs_of.values():  # warm-up
        run()
    rates: dict[str, list[float]] = {mode: [] for mode in runs_of}
    for _ in range(args.repeats):
        for mode, run in runs_of.items():
            llm.engine.core.scheduler.kv.reset_prefix_cache()  # no run feeds the next
            rates[mode].append(beam_tokens / timed(run))
    llm.close()
    throughput: dict[str, Any] = {mode: {"beam_tok_s": r, "median": statistics.median(r)}
                                  for mode, r in rates.items()}
    if args.transformers:
        throughput["transformers"] = _transformers_rate(model, prompts, width, args.output_len)
    ours = throughput["engine_beams"]["median"]
    for entry in throughput.values():
        entry["engine_beams_vs_this"] = ours / entry["median"]
    return {
        "date": now_iso(), "command": "tokenmill " + " ".join(sys.argv[1:]),
        "hardware": hardware(), "threads": args.threads, "model": model,
        "workload": {"num_prompts": args.num_prompts, "beam_width": width,
                     "input_len": args.input_len, "output_len": args.output_len},
        "throughput": throughput,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def request_per_step(llm: LLM, prompts: list[list[int]], width: int,
                     output_len: int) -> list[list[list[int]]]:
    """vLLM's beam search (no EOS): each step, one-token requests for every live beam of
    every prompt, each carrying its whole sequence (the prefix cache serves what it can);
    the top ``width`` continuations by summed logprob go on. Returns each prompt's beams."""
    beams = [[(list(p), 0.0)] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width)
    for _ in range(output_len):
        flat = [(i, seq, score) for i, live in enumerate(beams) for seq, score in live]
        outs = llm.generate([seq for _, seq, _ in flat], params, use_tqdm=False)
        candidates: list[list[tuple[list[int], float]]] = [[] for _ in prompts]
        for (i, seq, score), out in zip(flat, outs, strict=True):
            top = out.outputs[0].logprobs[0].top  # type: ignore[index]
            candidates[i].extend(([*seq, t], score + lp) for t, lp in top.items())
        beams = [sorted(c, key=lambda b: -b[1])[:width] for c in candidates]
    return [[seq for seq, _ in live] for live in beams]


def _transformers_rate(model: str, prompts: list[list[int]], width: int,
                       output_len: int) -> dict[str, Any]:
    """transformers' beam search on the workload as one left-padded batch (one run after a
    short warm-up), in fp32."""
    import transformers

    if model.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(model))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                               dtype=torch.float32)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.eval()
    pad = hf.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])

    def run(n: int) -> None:
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                        min_new_tokens=n, num_beams=width, num_return_sequences=width,
                        do_sample=False, pad_token_id=pad)

    run(2)
    rate = len(prompts) * width * output_len / timed(lambda: run(output_len))
    return {"beam_tok_s": [rate], "median": rate, "dtype": "float32",
            "transformers": transformers.__version__}


def _print(result: dict[str, Any]) -> None:
    w, t = result["workload"], result["throughput"]
    print(f"{w['num_prompts']} prompts x {w['beam_width']} beams x ({w['input_len']} in, "
          f"{w['output_len']} out), EOS ignored")
    print(f"{'mode':<18}{'median beam tok/s':>19}{'engine beams vs it':>20}  runs")
    for mode in (*ENGINE_MODES, "transformers"):
        if mode in t:
            runs = ", ".join(f"{x:.1f}" for x in t[mode]["beam_tok_s"])
            print(f"{mode:<18}{t[mode]['median']:>19.1f}{t[mode]['engine_beams_vs_this']:>19.2f}x"
                  f"  {runs}")
    print(f"hardware: {hardware_line(result['hardware'])}; load average before/after: "
          f"{result['load_before']} / {result['load_after']}")
