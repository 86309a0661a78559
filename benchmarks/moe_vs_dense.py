"""A mixture-of-experts model against the dense model of equal active parameters, on the CPU:
single-stream decode and 32-stream decode throughput (issue 57, item 5).

Both are random-weight models (``load_format="dummy"``) written here as Hugging Face folders:
a Mixtral-shaped MoE (``--experts`` experts of width ``--expert-width``, top ``--top-k``) and
a Llama of the same attention whose MLP is ``top_k * expert_width`` wide, so a token reads as
many weights in both. Both run on the CPU op program (their fast path: the MoE's sparse layers
are its ``moe`` op), and both are also measured on ``model.forward`` (the MoE with the grouped
PyTorch experts) to separate the two effects. A markdown table goes next to the JSON.

    python benchmarks/moe_vs_dense.py [--quantization int8|int4] [--steps 12] [--rounds 3]
        [--threads 1]
        [--result-file benchmarks/results/moe-vs-dense-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill import LLM
from tokenmill.bench.latency import start_decoding
from tokenmill.bench.report import (
    command_line,
    hardware,
    hardware_line,
    markdown_table,
    now_iso,
    write_json,
)


@dataclass(frozen=True)
class Shape:
    """The two models' common shape and the MoE's experts."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int
    top_k: int
    expert_width: int

    def config(self, moe: bool) -> dict[str, Any]:
        """config.json of the MoE (Mixtral) or of the dense model (Llama)."""
        common = dict(vocab_size=self.vocab, hidden_size=self.hidden,
                      num_hidden_layers=self.layers, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
        if moe:
            return dict(common, architectures=["MixtralForCausalLM"],
                        intermediate_size=self.expert_width, num_local_experts=self.experts,
                        num_experts_per_tok=self.top_k)
        return dict(common, architectures=["LlamaForCausalLM"],
                    intermediate_size=self.top_k * self.expert_width)

    def params(self, moe: bool) -> tuple[int, int]:
        """(total, active per token) weights, embedding and head included."""
        head_dim = self.hidden // self.heads
        attn = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        outer = 2 * self.vocab * self.hidden
        expert = 3 * self.hidden * self.expert_width
        if not moe:
            dense = self.layers * (attn + self.top_k * expert) + outer
            return dense, dense
        router = self.hidden * self.experts
        base = self.layers * (attn + router) + outer
        return base + self.layers * self.experts * expert, base + self.layers * self.top_k * expert


def write_folder(path: Path, config: dict[str, Any]) -> None:
    """config.json and a word-level tokenizer: all a dummy-weight load reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1",
                                                            "eos_token": "t2"}))


def step_times(llm: LLM, batch: int, prompt: int, steps: int, seed: int) -> list[float]:
    """Seconds of each of ``steps`` decode-only steps of ``batch`` sequences."""
    engine = llm.engine
    start_decoding(engine, batch, prompt, steps, seed=seed)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def build(path: Path, args: argparse.Namespace, op_program: bool) -> LLM:
    """The engine of the folder's dummy-weight model, on the CPU op program or not."""
    os.environ["TOKENMILL_FUSED_DECODE"] = "1" if op_program else "0"
    try:
        return LLM(str(path), load_format="dummy", quantization=args.quantization,
                   max_model_len=512, max_num_seqs=args.streams,
                   kv_cache_memory_bytes=256 << 20, num_threads=args.threads)
    finally:
        os.environ.pop("TOKENMILL_FUSED_DECODE", None)


def measure(engines: dict[str, LLM], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Tokens/s of each engine at 1 and ``args.streams`` streams: ``batch`` over the median
    step time, the engines taking turns round by round so that all see the same machine (on a
    shared one a step the OS preempted takes a whole time slice more: hence the median)."""
    times: dict[str, dict[int, list[float]]] = {n: {1: [], args.streams: []} for n in engines}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, llm in engines.items():
            for batch in (1, args.streams):
                t = step_times(llm, batch, args.prompt, args.steps, seed=r)
                if r:
                    times[name][batch] += t
    return {name: {f"{b}_stream_tok_s": b / statistics.median(ts) for b, ts in by.items()}
            for name, by in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantization", default="int8", choices=["none", "int8", "int4"])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of each stream")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--steps", type=int, default=12, help="timed decode steps a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="the engine's threads (default: every core); 1 on a crowded machine, "
                   "where the PyTorch ops of model.forward wait at each barrier for a thread "
                   "the OS descheduled")
    p.add_argument("--result-file", default="benchmarks/results/moe-vs-dense-cpu.json")
    args = p.parse_args()
    shape = Shape(args.hidden, args.layers, args.hidden // 64, max(1, args.hidden // 256),
                  32000, args.experts, args.top_k, args.expert_width)
    models = (("moe", True, True), ("dense", False, True), ("moe (model.forward)", True, False),
              ("dense (model.forward)", False, False))
    engines: dict[str, LLM] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, moe, program in models:
            folder = Path(tmp) / ("moe" if moe else "dense")
            write_folder(folder, shape.config(moe))
            engines[name] = build(folder, args, program)
        rates = measure(engines, args)
    rows = []
    for name, moe, _ in models:
        total, active = shape.params(moe)
        rows.append({"model": name, "step_backend":
                     engines[name].engine.core.executor.runner.step_backend.name,
                     "total_params_m": total / 1e6, "active_params_m": active / 1e6,
                     **rates[name]})
    hw = hardware()
    headers = ["model", "total M", "active M", "step backend", "1-stream tok/s",
               f"{args.streams}-stream tok/s"]
    table = markdown_table(headers, [
        [r["model"], f"{r['total_params_m']:.0f}", f"{r['active_params_m']:.0f}",
         r["step_backend"], f"{r['1_stream_tok_s']:.1f}",
         f"{r[f'{args.streams}_stream_tok_s']:.1f}"] for r in rows])
    command = command_line("benchmarks/moe_vs_dense.py", sys.argv[1:])
    summary = (f"{hardware_line(hw)}; quantization {args.quantization}; threads "
               f"{args.threads or 'all'}")
    print(f"\n{summary}\n\n{table}")
    Path(args.result_file).with_suffix(".md").write_text(
        f"{summary}\n\n`python {command}`\n\n{table}\n")
    write_json(args.result_file, {"when": now_iso(), "hardware": hw, "shape": shape.__dict__,
                                  "quantization": args.quantization, "rows": rows,
                                  "threads": args.threads,
                                  "command": command})


if __name__ == "__main__":
    main()
