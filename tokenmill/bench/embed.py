"""`tokenmill bench embed`: tokenmill's embeddings against sentence-transformers on the same
model folder, in one process.

Parity: the cosine similarity of the two embeddings of each of the hand-written sentences of
``embed_sentences.PARITY_SENTENCES``. Throughput: sentences/s over generated sentences of a
word range, both engines at the same thread count, runs alternated (tokenmill, then
sentence-transformers, repeated) so that a change in the machine's load hits both; the
median run of each is compared. Writes a JSON file with the hardware, the command and the load
average around the runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

from tokenmill import envs
from tokenmill.bench.embed_sentences import PARITY_SENTENCES, generated_sentences
from tokenmill.bench.report import hardware, hardware_line, now_iso, write_json
from tokenmill.engine.llm import LLM
from tokenmill.model_loader import embedded_embedding_model_path
from tokenmill.models.layers import Bf16MatmulLinear
from tokenmill.quant.packing import dense_dtype

DEFAULT_OUTPUT = "benchmarks/results/embed-cpu.json"
PARITY_GOAL = 0.9999


def add_embed_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench embed`."""
    p = subparsers.add_parser("embed", help="embeddings: parity and throughput vs "
                                            "sentence-transformers")
    p.add_argument("--model", default=None,
                   help="embedding model folder (default: the embedded all-MiniLM-L6-v2)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (default: every core this process may use)")
    p.add_argument("--num-sentences", type=int, default=1000, help="sentences to embed")
    p.add_argument("--min-words", type=int, default=10, help="fewest words in a sentence")
    p.add_argument("--max-words", type=int, default=60, help="most words in a sentence")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of each engine")
    p.add_argument("--st-batch-size", type=int, default=32,
                   help="sentence-transformers' batch size (its default: 32)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one engine step at most (the running batch)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per engine step (larger steps spill the activations out of "
                        "the caches: measured no faster)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32"),
                   help="tokenmill's dtype (auto: fp32 with bf16 matmuls on CPUs that multiply "
                        "bf16 natively, else fp32)")
    p.add_argument("--no-st-bf16", dest="st_bf16", action="store_false",
                   help="skip sentence-transformers in bf16 (measured by default where the CPU "
                        "multiplies bf16 natively, beside its fp32 default)")
    p.add_argument("--skip-throughput", action="store_true", help="parity only")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="where to write")
    p.set_defaults(func=cmd_embed)


def _st_embed(st: Any, texts: list[str]) -> torch.Tensor:
    return st.encode(texts, convert_to_tensor=True, batch_size=32,
                     show_progress_bar=False).float().cpu()


def parity(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Cosine similarity per parity sentence of two engines' embeddings ``[sentences, dim]``
    (``ref``: sentence-transformers in fp32)."""
    texts = list(PARITY_SENTENCES)
    sims = torch.nn.functional.cosine_similarity(ours, ref, dim=1).tolist()
    worst = min(range(len(sims)), key=lambda i: sims[i])
    return {"num_sentences": len(texts), "min_cosine": min(sims),
            "mean_cosine": statistics.fmean(sims), "worst_sentence": texts[worst],
            "num_below_goal": sum(s < PARITY_GOAL for s in sims), "goal": PARITY_GOAL}


def timed(fn: Any) -> float:
    """Seconds ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternated_rates(engines: dict[str, Any], count: int, repeats: int) -> dict[str, list[float]]:
    """``count`` items / s of each engine's call, ``repeats`` rounds of one run each in turn,
    so that a change in the machine's load hits every engine."""
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, fn in engines.items():
            runs[name].append(count / timed(fn))
    return runs


def matmul_kind(llm: LLM) -> str:
    """What the engine's model multiplies in: "bf16 (fp32 around them)" for an encoder's
    bf16 projections, else its parameters' dtype."""
    model = llm.engine.core.executor.local_model()
    if any(isinstance(m, Bf16MatmulLinear) for m in model.modules()):
        return "bf16 (fp32 around them)"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def throughput(llm: LLM, st: Any, sentences: list[str], repeats: int,
               st_batch_size: int, st_bf16: Any = None) -> dict[str, Any]:
    """Sentences/s of each engine, runs alternated; a warm-up run of each first.
    ``speedup_median`` is against sentence-transformers as it runs by default (fp32)."""
    engines = {
        "tokenmill": lambda: llm.embed(sentences),
        "sentence_transformers": lambda: st.encode(sentences, batch_size=st_batch_size,
                                                   show_progress_bar=False),
    }
    if st_bf16 is not None:
        engines["sentence_transformers_bf16"] = lambda: st_bf16.encode(
            sentences, batch_size=st_batch_size, show_progress_bar=False)
    for fn in engines.values():  # warm-up: first-call allocations, lazy inits
        fn()
    runs = alternated_rates(engines, len(sentences), repeats)
    result: dict[str, Any] = {name: {"sentences_per_s": r, "median": statistics.median(r)}
                              for name, r in runs.items()}
    result["speedup_median"] = (result["tokenmill"]["median"]
                                / result["sentence_transformers"]["median"])
    if st_bf16 is not None:
        result["speedup_vs_bf16_median"] = (result["tokenmill"]["median"]
                                            / result["sentence_transformers_bf16"]["median"])
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"tokenmill matmuls: {result['tokenmill_matmuls']}")
    for key, who in (("parity", "tokenmill"), ("parity_st_bf16", "sentence-transformers bf16")):
        p = result.get(key)
        if p:
            print(f"parity of {who} on {p['num_sentences']} sentences: min cosine "
                  f"{p['min_cosine']:.7f}, mean {p['mean_cosine']:.7f} "
                  f"({p['num_below_goal']} below {p['goal']})")
    t = result.get("throughput")
    if t:
        print(f"{'engine':<30}{'median sent/s':>14}  runs")
        for name in ("tokenmill", "sentence_transformers", "sentence_transformers_bf16"):
            if name in t:
                runs = ", ".join(f"{x:.1f}" for x in t[name]["sentences_per_s"])
                print(f"{name:<30}{t[name]['median']:>14.1f}  {runs}")
        print(f"speedup (medians) vs sentence-transformers fp32: {t['speedup_median']:.2f}x")
        if "speedup_vs_bf16_median" in t:
            print(f"speedup (medians) vs sentence-transformers bf16: "
                  f"{t['speedup_vs_bf16_median']:.2f}x")
    print(f"hardware: {hardware_line(result['hardware'])}; load average before/after: "
          f"{result['load_before']} / {result['load_after']}")


def cmd_embed(args: argparse.Namespace) -> int:
    """Run the benchmark, print a table, write the JSON."""
    from sentence_transformers import SentenceTransformer

    folder = args.model or embedded_embedding_model_path()
    torch.set_num_threads(args.threads)
    llm = LLM(folder, task="embed", num_threads=args.threads, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
    matmuls = matmul_kind(llm)
    st = SentenceTransformer(folder, device="cpu")
    native_bf16 = dense_dtype("cpu") == torch.bfloat16
    st_bf16 = (SentenceTransformer(folder, device="cpu",
                                   model_kwargs={"torch_dtype": torch.bfloat16})
               if args.st_bf16 and native_bf16 else None)
    load_before = os.getloadavg()
    texts = list(PARITY_SENTENCES)
    ref = _st_embed(st, texts)
    result: dict[str, Any] = {
        "date": now_iso(), "command": "tokenmill " + " ".join(sys.argv[1:]),
        "hardware": hardware(), "threads": args.threads, "model": folder,
        "omp_wait_policy": envs.OMP_WAIT_POLICY,
        "tokenmill_dtype": args.dtype, "tokenmill_matmuls": matmuls,
        "cpu_native_bf16": native_bf16,
        "parity": parity(torch.tensor([o.embedding for o in llm.embed(texts)]), ref)}
    if st_bf16 is not None:
        result["parity_st_bf16"] = parity(_st_embed(st_bf16, texts), ref)
    if not args.skip_throughput:
        sentences = generated_sentences(args.num_sentences, args.min_words, args.max_words)
        tokens = sum(len(ids) for ids in (llm.get_tokenizer().encode(s) for s in sentences))
        result["workload"] = {"num_sentences": len(sentences), "words": [args.min_words,
                              args.max_words], "tokens": tokens,
                              "st_batch_size": args.st_batch_size,
                              "max_num_seqs": args.max_num_seqs,
                              "max_num_batched_tokens": args.max_num_batched_tokens}
        result["throughput"] = throughput(llm, st, sentences, args.repeats, args.st_batch_size,
                                          st_bf16)
    result["load_before"] = [round(x, 2) for x in load_before]
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    llm.close()
    _print(result)
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return 0
