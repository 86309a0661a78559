"""Compare the embedded vector databases the retrieval layer could sit on (issue 15): insert and
search latency, recall against brute force, filtered search and reopening from disk, for
synthetic 384-dim vectors (MiniLM's width) drawn around topic centres like real chunk embeddings.

Each database runs in its own process, with its packages installed in a folder of its own so
their dependencies never mix with tokenmill's environment:

    for p in sqlite-vec apsw faiss-cpu lancedb chromadb; do
        pip install --target /tmp/vdb/$p -c constraints.txt $p; done
    python benchmarks/vector_db_compare.py --site /tmp/vdb --n 10000 100000 \
        --out benchmarks/results/vector-db-compare-cpu.json

Printed: one row per database and size; the JSON holds the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

DIM = 384
K = 10
NUM_QUERIES = 100
NUM_FILES = 100
BATCH = 1000  # rows per insert call: about one attached file's chunks, a few times over


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` unit vectors around 200 topic centres, their file ids, and held-out queries."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((200, DIM)).astype(np.float32)
    topic = rng.integers(0, 200, n + NUM_QUERIES)
    x = centres[topic] + 0.9 * rng.standard_normal((n + NUM_QUERIES, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    files = rng.integers(0, NUM_FILES, n)
    return x[:n], files, x[n:]


def exact(x: np.ndarray, q: np.ndarray, mask: np.ndarray | None = None) -> list[set[int]]:
    """The true top-K row ids of each query (cosine = dot product of unit vectors)."""
    s = q @ x.T
    if mask is not None:
        s[:, ~mask] = -np.inf
    return [set(np.argsort(-row)[:K].tolist()) for row in s]


class Backend:
    """One database: ``insert`` rows, ``search`` top-K (optionally only files < 10)."""

    def open(self, path: str) -> None: ...
    def insert(self, ids: np.ndarray, x: np.ndarray, files: np.ndarray) -> None: ...
    def search(self, q: np.ndarray, filtered: bool) -> list[int]: ...
    def count(self) -> int: ...
    def close(self) -> None: ...


class Faiss(Backend):
    """FAISS exact inner-product index + SQLite for rows; the index is rebuilt from SQLite."""

    def open(self, path: str) -> None:
        import sqlite3

        import faiss
        # One query at a time: OpenMP's thread start costs more than it saves.
        faiss.omp_set_num_threads(1)
        self.faiss = faiss
        self.db = sqlite3.connect(os.path.join(path, "f.sqlite"))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS c (id INTEGER PRIMARY KEY, file INT, v BLOB)")
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(DIM))
        rows = self.db.execute("SELECT id, v FROM c").fetchall()
        if rows:
            ids = np.array([r[0] for r in rows], dtype=np.int64)
            x = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(-1, DIM)
            self.index.add_with_ids(x, ids)
        self.files = dict(self.db.execute("SELECT id, file FROM c").fetchall())

    def insert(self, ids: np.ndarray, x: np.ndarray, files: np.ndarray) -> None:
        with self.db:
            self.db.executemany("INSERT INTO c VALUES (?, ?, ?)", [
                (int(i), int(f), v.tobytes()) for i, f, v in zip(ids, files, x, strict=True)])
        self.index.add_with_ids(x, ids.astype(np.int64))
        self.files.update(zip(ids.tolist(), files.tolist(), strict=True))

    def search(self, q: np.ndarray, filtered: bool) -> list[int]:
        params = None
        if filtered:
            ok = np.array([i for i, f in self.files.items() if f < 10], dtype=np.int64)
            params = self.faiss.SearchParameters(sel=self.faiss.IDSelectorBatch(ok))
        _, ids = self.index.search(q[None], K, params=params)
        return [int(i) for i in ids[0] if i >= 0]

    def count(self) -> int:
        return self.index.ntotal

    def close(self) -> None:
        self.db.close()


class SqliteVec(Backend):
    """sqlite-vec's vec0 table (exact KNN) with the file id as a metadata column, through apsw
    (this Python's sqlite3 module cannot load extensions)."""

    def open(self, path: str) -> None:
        import apsw
        import sqlite_vec
        self.db = apsw.Connection(os.path.join(path, "v.sqlite"))
        self.db.enable_load_extension(True)
        self.db.load_extension(sqlite_vec.loadable_path())
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"CREATE VIRTUAL TABLE IF NOT EXISTS c USING vec0("
                        f"id INTEGER PRIMARY KEY, v float[{DIM}] distance_metric=cosine, "
                        f"file INTEGER)")

    def insert(self, ids: np.ndarray, x: np.ndarray, files: np.ndarray) -> None:
        with self.db:
            self.db.executemany("INSERT INTO c(id, v, file) VALUES (?, ?, ?)", [
                (int(i), v.tobytes(), int(f)) for i, f, v in zip(ids, files, x, strict=True)])

    def search(self, q: np.ndarray, filtered: bool) -> list[int]:
        where = "AND file < 10" if filtered else ""
        rows = self.db.execute(f"SELECT id FROM c WHERE v MATCH ? AND k = {K} {where} "
                               "ORDER BY distance", (q.tobytes(),)).fetchall()
        return [r[0] for r in rows]

    def count(self) -> int:
        return self.db.execute("SELECT count(*) FROM c").fetchall()[0][0]

    def close(self) -> None:
        self.db.close()


class Lance(Backend):
    """LanceDB, without an index (exact scan) unless ``--lance-index`` builds IVF-PQ."""

    index = False

    def open(self, path: str) -> None:
        import lancedb
        self.db = lancedb.connect(path)
        self.t = self.db.open_table("c") if "c" in self.db.table_names() else None

    def insert(self, ids: np.ndarray, x: np.ndarray, files: np.ndarray) -> None:
        rows = [{"id": int(i), "file": int(f), "vector": v} for i, f, v in zip(ids, files, x, strict=True)]
        if self.t is None:
            self.t = self.db.create_table("c", rows)
        else:
            self.t.add(rows)

    def finish(self) -> None:
        if self.index:
            self.t.create_index(metric="cosine", vector_column_name="vector")

    def search(self, q: np.ndarray, filtered: bool) -> list[int]:
        s = self.t.search(q, vector_column_name="vector").metric("cosine").limit(K)
        if filtered:
            s = s.where("file < 10", prefilter=True)
        return s.to_arrow().column("id").to_pylist()

    def count(self) -> int:
        return self.t.count_rows()

    def close(self) -> None:
        pass


class LanceIndexed(Lance):
    index = True


class Chroma(Backend):
    """Chroma's persistent client (HNSW index, SQLite for metadata)."""

    def open(self, path: str) -> None:
        import chromadb
        self.client = chromadb.PersistentClient(path=path)
        self.c = self.client.get_or_create_collection("chunks", metadata={"hnsw:space": "cosine"})

    def insert(self, ids: np.ndarray, x: np.ndarray, files: np.ndarray) -> None:
        self.c.add(ids=[str(i) for i in ids], embeddings=x,
                   metadatas=[{"file": int(f)} for f in files])

    def search(self, q: np.ndarray, filtered: bool) -> list[int]:
        r = self.c.query(query_embeddings=q[None], n_results=K,
                         where={"file": {"$lt": 10}} if filtered else None)
        return [int(i) for i in r["ids"][0]]

    def count(self) -> int:
        return self.c.count()

    def close(self) -> None:
        pass


BACKENDS: dict[str, tuple[type[Backend], list[str]]] = {
    "faiss+sqlite": (Faiss, ["faiss-cpu"]),
    "sqlite-vec": (SqliteVec, ["sqlite-vec", "apsw"]),
    "lancedb": (Lance, ["lancedb"]),
    "lancedb-ivfpq": (LanceIndexed, ["lancedb"]),
    "chroma": (Chroma, ["chromadb"]),
}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run_one(name: str, n: int) -> dict[str, Any]:
    """Insert ``n`` rows, search, reopen: the numbers of one database at one size."""
    x, files, q = make_data(n)
    truth, truth_f = exact(x, q), exact(x, q, files < 10)
    path = tempfile.mkdtemp(prefix="vdb-")
    db = BACKENDS[name][0]()
    db.open(path)
    ids = np.arange(n)
    t_ins = 0.0
    for s in range(0, n, BATCH):
        t_ins += timed(lambda s=s: db.insert(ids[s:s + BATCH], x[s:s + BATCH],
                                             files[s:s + BATCH]))[0]
    if hasattr(db, "finish"):
        t_ins += timed(db.finish)[0]
    out: dict[str, Any] = {"db": name, "n": n, "insert_s": round(t_ins, 3),
                           "insert_rows_per_s": round(n / t_ins)}
    for filtered, tr in ((False, truth), (True, truth_f)):
        lat, hits = [], 0
        for qi, qv in enumerate(q):
            dt, got = timed(lambda qv=qv, fl=filtered: db.search(qv, fl))
            lat.append(dt)
            hits += len(tr[qi] & set(got))
        key = "filtered_" if filtered else ""
        out[key + "search_p50_ms"] = round(1e3 * float(np.median(lat)), 2)
        out[key + "recall_at_10"] = round(hits / (K * len(q)), 4)
    db.close()
    t_open, _ = timed(lambda: db.open(path))
    out["reopen_s"] = round(t_open, 3)
    out["rows_after_reopen"] = db.count()
    out["disk_mb"] = round(sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path)
                               for f in fs) / 2**20, 1)
    db.close()
    shutil.rmtree(path, ignore_errors=True)
    return out


def install_mb(site: str, packages: list[str]) -> float:
    """Megabytes the packages and their dependencies take in ``site`` (numpy included)."""
    return round(sum(os.path.getsize(os.path.join(r, f)) for p in packages
                     for r, _, fs in os.walk(os.path.join(site, p)) for f in fs) / 2**20)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--site", default="/tmp/vdb", help="folder with one --target install per db")
    p.add_argument("--db", nargs="*", default=list(BACKENDS))
    p.add_argument("--n", type=int, nargs="*", default=[10000, 100000])
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_one(args.db[0], args.n[0])))
        return 0
    results = []
    for n in args.n:
        for name in args.db:
            pkgs = BACKENDS[name][1]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                os.path.join(args.site, pk) for pk in pkgs))
            proc = subprocess.run([sys.executable, __file__, "--child", "--db", name, "--n",
                                   str(n)], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name} n={n} failed: {proc.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["install_mb"] = install_mb(args.site, pkgs)
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "dim": DIM, "k": K,
                       "queries": NUM_QUERIES, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
