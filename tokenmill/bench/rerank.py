"""`tokenmill bench rerank`: a cross-encoder's pair scores, tokenmill's ``LLM.score`` against
sentence-transformers' ``CrossEncoder.predict`` on the same folder, in one process.

Without ``--model`` the folder is a random cross-encoder of ms-marco-MiniLM-L-6-v2's shape
(BERT, 6 layers of 384, 12 heads, one label, all-MiniLM's tokenizer), saved by transformers:
no model can be downloaded here, and speed does not depend on the weights' values. The
workload is queries, each paired with the same number of generated documents. Parity: the
largest difference between the two engines' scores of the workload's pairs. Throughput:
pairs/s, runs alternated (tokenmill, then sentence-transformers, repeated) so that a change
in the machine's load hits both; the median run of each is compared. Writes a JSON file with
the hardware, the command and the load average around the runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.embed import alternated_rates, matmul_kind
from tokenmill.bench.embed_sentences import generated_sentences
from tokenmill.bench.report import hardware, hardware_line, now_iso, write_json
from tokenmill.engine.llm import LLM
from tokenmill.model_loader import embedded_embedding_model_path

DEFAULT_OUTPUT = "benchmarks/results/rerank-cpu.json"
# ms-marco-MiniLM-L-6-v2's config.json, the weights left random.
MSMARCO_MINILM_SHAPE = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                            num_attention_heads=12, intermediate_size=1536,
                            max_position_embeddings=512, type_vocab_size=2, num_labels=1)
# Random weights at BERT's usual 0.02 give every pair nearly the same score (a spread of
# ~1e-3 over the workload), where ranking means nothing; at 0.1 the scores spread like a
# trained reranker's (standard deviation ~0.2).
INIT_RANGE = 0.1


def add_rerank_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench rerank`."""
    p = subparsers.add_parser("rerank", help="cross-encoder pair scores: parity and "
                                             "throughput vs sentence-transformers")
    p.add_argument("--model", default=None,
                   help="cross-encoder folder (default: a random one of "
                        "ms-marco-MiniLM-L-6-v2's shape)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--num-queries", type=int, default=16, help="queries")
    p.add_argument("--docs-per-query", type=int, default=32, help="documents paired with each")
    p.add_argument("--min-words", type=int, default=20, help="fewest words in a document")
    p.add_argument("--max-words", type=int, default=80, help="most words in a document")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of each engine")
    p.add_argument("--st-batch-size", type=int, default=32,
                   help="sentence-transformers' batch size (its default: 32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per engine step")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32"),
                   help="tokenmill's dtype (auto: fp32 with bf16 matmuls on CPUs that multiply "
                        "bf16 natively, else fp32)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="where to write")
    p.set_defaults(func=cmd_rerank)


def save_msmarco_shaped_cross_encoder(folder: Path, seed: int = 0) -> None:
    """A random cross-encoder of ms-marco-MiniLM-L-6-v2's shape, with all-MiniLM's tokenizer
    (the same BERT uncased vocabulary)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    model = BertForSequenceClassification(BertConfig(**MSMARCO_MINILM_SHAPE,
                                                     initializer_range=INIT_RANGE))
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(Path(embedded_embedding_model_path()) / "tokenizer.json",
                folder / "tokenizer.json")


def workload(num_queries: int, docs_per_query: int, min_words: int,
             max_words: int) -> tuple[list[str], list[str]]:
    """The pairs as two lists: each query repeated against its documents."""
    queries = generated_sentences(num_queries, 4, 12, seed=1)
    docs = generated_sentences(num_queries * docs_per_query, min_words, max_words, seed=2)
    return [q for q in queries for _ in range(docs_per_query)], docs


def cmd_rerank(args: argparse.Namespace) -> int:
    """Run the benchmark, print a table, write the JSON."""
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(args.threads)
    scratch = None
    folder = args.model
    if folder is None:
        scratch = tempfile.mkdtemp(prefix="tokenmill-rerank-")
        save_msmarco_shaped_cross_encoder(Path(scratch))
        folder = scratch
    try:
        llm = LLM(folder, task="embed", num_threads=args.threads,
                  max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
        st = CrossEncoder(folder, device="cpu")
        first, second = workload(args.num_queries, args.docs_per_query, args.min_words,
                                 args.max_words)
        pairs = list(zip(first, second, strict=True))
        load_before = os.getloadavg()
        scored = llm.score(first, second)
        ours = torch.tensor([o.outputs.score for o in scored])
        ref = torch.as_tensor(st.predict(pairs, batch_size=args.st_batch_size,
                                         show_progress_bar=False)).float()
        tokens = sum(len(o.prompt_token_ids) for o in scored)
        engines = {
            "tokenmill": lambda: llm.score(first, second),
            "sentence_transformers": lambda: st.predict(pairs, batch_size=args.st_batch_size,
                                                        show_progress_bar=False),
        }
        runs = alternated_rates(engines, len(pairs), args.repeats)
        throughput: dict[str, Any] = {name: {"pairs_per_s": r, "median": statistics.median(r)}
                                      for name, r in runs.items()}
        throughput["speedup_median"] = (throughput["tokenmill"]["median"]
                                        / throughput["sentence_transformers"]["median"])
        result: dict[str, Any] = {
            "date": now_iso(), "command": "tokenmill " + " ".join(sys.argv[1:]),
            "hardware": hardware(), "threads": args.threads,
            "model": args.model or (f"random (initializer_range {INIT_RANGE}), "
                                    "ms-marco-MiniLM-L-6-v2's shape"),
            "tokenmill_dtype": args.dtype, "tokenmill_matmuls": matmul_kind(llm),
            "workload": {"num_pairs": len(pairs), "num_queries": args.num_queries,
                         "docs_per_query": args.docs_per_query,
                         "words": [args.min_words, args.max_words],
                         "tokens": tokens, "st_batch_size": args.st_batch_size,
                         "max_num_batched_tokens": args.max_num_batched_tokens},
            "parity": {"max_abs_diff": float((ours - ref).abs().max()),
                       "score_std": float(ref.std()),
                       **ranking_agreement(ours, ref, args.docs_per_query)},
            "throughput": throughput,
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
        }
        llm.close()
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    _print(result)
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return 0


def _ranks(scores: torch.Tensor, per_query: int) -> torch.Tensor:
    """Each document's rank among its query's documents (0: the best)."""
    return scores.view(-1, per_query).argsort(dim=1, descending=True).argsort(dim=1)


def ranking_agreement(ours: torch.Tensor, ref: torch.Tensor, per_query: int) -> dict[str, float]:
    """How alike two engines rank each query's documents: the share of queries whose best
    document is the same, whose whole order is the same, and the mean Spearman correlation
    of the ranks."""
    a, b = _ranks(ours, per_query).double(), _ranks(ref, per_query).double()
    a, b = a - a.mean(dim=1, keepdim=True), b - b.mean(dim=1, keepdim=True)
    spearman = (a * b).sum(dim=1) / (a.norm(dim=1) * b.norm(dim=1))
    best = (ours.view(-1, per_query).argmax(dim=1) == ref.view(-1, per_query).argmax(dim=1))
    return {"same_best_per_query": float(best.double().mean()),
            "same_order_per_query": float((a == b).all(dim=1).double().mean()),
            "mean_spearman": float(spearman.mean())}


def _print(result: dict[str, Any]) -> None:
    w, p, t = result["workload"], result["parity"], result["throughput"]
    print(f"{w['num_pairs']} pairs ({w['num_queries']} queries x {w['docs_per_query']} "
          f"documents of {w['words'][0]}-{w['words'][1]} words); tokenmill matmuls: "
          f"{result['tokenmill_matmuls']}")
    print(f"parity: largest score difference {p['max_abs_diff']:.2e} (scores' standard "
          f"deviation {p['score_std']:.3f}); per query: same best document "
          f"{p['same_best_per_query']:.0%}, same order {p['same_order_per_query']:.0%}, "
          f"mean Spearman {p['mean_spearman']:.5f}")
    print(f"{'engine':<24}{'median pairs/s':>16}  runs")
    for name in ("tokenmill", "sentence_transformers"):
        runs = ", ".join(f"{x:.1f}" for x in t[name]["pairs_per_s"])
        print(f"{name:<24}{t[name]['median']:>16.1f}  {runs}")
    print(f"speedup (medians) vs sentence-transformers: {t['speedup_median']:.2f}x")
    print(f"hardware: {hardware_line(result['hardware'])}; load average before/after: "
          f"{result['load_before']} / {result['load_after']}")
