"""The vector index of each store: a FAISS exact inner-product index over unit vectors (so the
score is the cosine), keyed by the chunk ids of the catalog. Exact on purpose: at the sizes a
local server holds (up to ~100k chunks a store) a flat scan takes milliseconds and loses no
recall, where approximate indexes lose some (see the README's comparison).

Not thread-safe by itself: RetrievalService calls it from one thread only. FAISS is imported
on first use (faiss_module), not with the server: the import takes ~0.16 s of a start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType

import numpy as np

from tokenmill.api.errors import bad_request

# Per thread: whether FAISS should run on one OpenMP thread there (one_thread_faiss), and
# whether that has been applied.
_THREAD = threading.local()


def one_thread_faiss() -> None:
    """Mark the calling thread: FAISS computes on one OpenMP thread here (a thread
    initializer; applied by faiss_module when the thread first uses FAISS)."""
    _THREAD.one_thread = True


def faiss_module() -> ModuleType:
    """FAISS, imported the first time a store needs it."""
    import faiss

    if getattr(_THREAD, "one_thread", False) and not getattr(_THREAD, "applied", False):
        faiss.omp_set_num_threads(1)
        _THREAD.applied = True
    return faiss


def normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (zero rows stay zero), as float32."""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.where(norms == 0, 1, norms)


class StoreIndex:
    """One store's vectors, and which chunk ids belong to which file."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        faiss = faiss_module()
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self.by_file: dict[str, np.ndarray] = {}

    def add(self, file_id: str, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add a file's chunks (unit vectors)."""
        if vectors.shape[1] != self.dim:
            raise ValueError(f"embedding width {vectors.shape[1]} != the store's {self.dim}")
        self.index.add_with_ids(vectors, ids.astype(np.int64))
        old = self.by_file.get(file_id)
        self.by_file[file_id] = ids if old is None else np.concatenate([old, ids])

    def remove_file(self, file_id: str) -> None:
        """Drop a file's chunks."""
        ids = self.by_file.pop(file_id, None)
        if ids is not None and len(ids):
            self.index.remove_ids(faiss_module().IDSelectorBatch(ids.astype(np.int64)))

    def search(self, queries: np.ndarray, k: int,
               files: set[str] | None) -> list[tuple[int, float]]:
        """The best ``k`` (chunk id, score) over all queries (a chunk scores its best), only
        among ``files`` when given."""
        if self.index.ntotal == 0 or (files is not None and not files):
            return []
        if queries.shape[1] != self.dim:
            raise bad_request(f"the query embedding has {queries.shape[1]} dimensions but the "
                              f"vector store was built with {self.dim}: the embedding model "
                              "changed; re-attach the files", "query")
        params = None
        if files is not None and len(files) < len(self.by_file):
            allowed = [self.by_file[f] for f in files if f in self.by_file]
            if not allowed:
                return []
            faiss = faiss_module()
            params = faiss.SearchParameters(sel=faiss.IDSelectorBatch(np.concatenate(allowed)))
        scores, ids = self.index.search(queries, min(k, self.index.ntotal), params=params)
        best: dict[int, float] = {}
        for row_ids, row_scores in zip(ids, scores, strict=True):
            for cid, score in zip(row_ids.tolist(), row_scores.tolist(), strict=True):
                if cid >= 0 and score > best.get(cid, -np.inf):
                    best[cid] = score
        return sorted(best.items(), key=lambda kv: -kv[1])[:k]


class VectorIndex:
    """Every store's index, each loaded from the catalog the first time it is needed."""

    def __init__(self, load: Callable[[str], tuple[np.ndarray, list[str], np.ndarray]]) -> None:
        self._load = load
        self._stores: dict[str, StoreIndex] = {}

    def get(self, store_id: str, dim: int | None = None) -> StoreIndex | None:
        """The store's index, loaded if need be; None if it has no vectors and no ``dim``."""
        idx = self._stores.get(store_id)
        if idx is not None:
            return idx
        ids, files, vectors = self._load(store_id)
        if not len(ids) and dim is None:
            return None
        idx = StoreIndex(vectors.shape[1] if len(ids) else int(dim or 0))
        order: dict[str, list[int]] = {}
        for row, f in enumerate(files):
            order.setdefault(f, []).append(row)
        for f, rows in order.items():
            idx.add(f, ids[rows], vectors[rows])
        self._stores[store_id] = idx
        return idx

    def add(self, store_id: str, file_id: str, ids: list[int], vectors: np.ndarray) -> None:
        """Index a file's chunks, just committed to the catalog."""
        idx = self._stores.get(store_id)
        if idx is None:  # loading reads every committed chunk, these included
            self.get(store_id, vectors.shape[1])
            return
        idx.add(file_id, np.array(ids, dtype=np.int64), vectors)

    def check_dim(self, store_id: str, dim: int) -> None:
        """ValueError if the store holds vectors of another width than ``dim``."""
        idx = self.get(store_id)
        if idx is not None and idx.dim != dim:
            raise ValueError(f"the embedding model gives {dim} dimensions but the vector "
                             f"store holds {idx.dim}")

    def remove_file(self, store_id: str, file_id: str) -> None:
        """Drop a file's chunks from a store's index (if it is loaded)."""
        idx = self._stores.get(store_id)
        if idx is not None:
            idx.remove_file(file_id)

    def drop(self, store_id: str) -> None:
        """Forget a store's index."""
        self._stores.pop(store_id, None)
