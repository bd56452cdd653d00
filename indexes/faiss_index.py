"""FAISS (CPU) indexes: Flat, IVFFlat, IVFPQ with exact re-ranking, and HNSW as CAGRA's CPU twin.

FAISS labels are insertion order, so they are exactly the resident row numbers. Search parameters are always
set explicitly: FAISS defaults (nprobe 1, efSearch 16) differ from cuVS's.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

# Set before FAISS loads OpenMP: idle OpenMP threads must sleep, not spin on the two cores the HTTP server
# also needs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402

from . import hugepages  # noqa: E402
from .ann import IndexConfig, default_n_lists, default_pq_dim  # noqa: E402
from .cores import usable_cores  # noqa: E402
from .distance import omp_threads, uses_inner_product  # noqa: E402

VERSION = faiss.__version__
TRAIN_SAMPLE_PER_LIST = 256  # k-means sees at most this many points per list: enough, and bounded


def _use_threads(rows: int, threads: int | None) -> None:
    """OpenMP threads for the next FAISS call from this thread (the setting is per calling thread): `threads`
    (default all cores) for real work, one for a handful of rows, where waking a second thread costs more than it
    saves. With several worker processes sharing the cores, `threads` is their share: an OpenMP barrier waiting
    for a thread that has no core stalls the call, with the replica's lock held, for a scheduler tick or more."""
    omp_threads(1 if rows < 4 else threads or usable_cores())


def _metric(metric: str) -> int:
    return faiss.METRIC_INNER_PRODUCT if uses_inner_product(metric) else faiss.METRIC_L2


def _train_sample(vectors: np.ndarray, n_lists: int, seed: int = 1234) -> np.ndarray:
    limit = n_lists * TRAIN_SAMPLE_PER_LIST
    if len(vectors) <= limit:
        return vectors
    rows = np.random.default_rng(seed).choice(len(vectors), size=limit, replace=False)
    return vectors[np.sort(rows)]


class FaissIndex:
    engine = "faiss"
    supports_add = True
    supports_filter = True

    def __init__(self, config: IndexConfig, index: Any, threads: int | None = None, huge_pages: bool = True) -> None:
        self.config = config
        self.index = index
        self.threads = threads
        self.huge_pages = huge_pages  # back the vectors and graph with 2 MiB pages (hugepages.py)
        # Unfiltered searches' parameter objects, per (k, params): FAISS only reads them, and making one cost
        # more than a small search. Bounded: cleared when full.
        self._unfiltered: dict[tuple, tuple[Any, int]] = {}
        self._filtered: tuple | None = None  # (mask, shape, bitmap, (params, k)) of the last filtered search

    @classmethod
    def build(cls, config: IndexConfig, vectors: np.ndarray, threads: int | None = None,
              huge_pages: bool = True) -> "FaissIndex":
        """`threads`: the built index's, for its searches and adds. The build itself takes every core: builds run
        on a thread of lower CPU priority, whose OpenMP threads take only what searches leave."""
        every_core = usable_cores()
        _use_threads(len(vectors), every_core)
        d, metric, p, n = config.dim, _metric(config.metric), config.params, len(vectors)
        t = config.index_type
        index: faiss.Index
        if t == "brute_force":
            index = faiss.IndexFlat(d, metric)
        elif t in ("hnsw", "cagra"):
            m = p["m"] if t == "hnsw" else max(4, p["graph_degree"] // 2)
            index = hnsw = faiss.IndexHNSWFlat(d, m, metric)
            hnsw.hnsw.efConstruction = p["ef_construction"] if t == "hnsw" else p["intermediate_graph_degree"]
        elif t in ("ivf_flat", "ivf_pq"):
            # FAISS's Python constructors keep a reference to the quantizer / base index they are given.
            n_lists = p.get("n_lists") or default_n_lists(n)
            quantizer = faiss.IndexFlat(d, metric)
            if t == "ivf_flat":
                index = faiss.IndexIVFFlat(quantizer, d, n_lists, metric)
            else:
                pq_dim = p.get("pq_dim") or default_pq_dim(d, p.get("pq_bits", 8))
                ivf = faiss.IndexIVFPQ(quantizer, d, n_lists, pq_dim, p.get("pq_bits", 8), metric)
                index = faiss.IndexRefineFlat(ivf)  # keeps the raw vectors to re-rank PQ candidates exactly
            index.train(_train_sample(vectors, n_lists))
        else:
            raise ValueError(f"FAISS has no index type {t!r}")
        built = cls(config, index, threads, huge_pages)
        if n:
            built.add(vectors, every_core)
        return built

    @classmethod
    def from_bytes(cls, config: IndexConfig, data: bytes, threads: int | None = None,
                   huge_pages: bool = True) -> "FaissIndex":
        loaded = cls(config, faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8)), threads, huge_pages)
        loaded._back(collapse=True)
        return loaded

    def to_bytes(self) -> bytes:
        return faiss.serialize_index(self.index).tobytes()

    @property
    def size(self) -> int:
        return int(self.index.ntotal)

    def copy_for_growth(self) -> "FaissIndex | None":
        """A copy to add rows to, where adding them gives the index a build over all the rows would: flat and
        HNSW indexes (building an HNSW graph is adding its rows in turn); None for IVF, whose lists were trained
        on the rows it was built over."""
        if self.config.index_type not in ("brute_force", "hnsw", "cagra"):
            return None
        copy = FaissIndex(self.config, faiss.clone_index(self.index), self.threads, self.huge_pages)
        copy._back(collapse=True)
        return copy

    def add(self, vectors: np.ndarray, threads: int | None = None) -> None:
        _use_threads(len(vectors), threads or self.threads)
        self.index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        self._back(collapse=len(vectors) >= hugepages.COLLAPSE_ROWS)

    def _back(self, collapse: bool) -> None:
        if self.huge_pages:
            hugepages.back_index(self.index, collapse)

    def _search_parameters(self, k: int, params: dict[str, Any], selector: Any) -> tuple[Any, int]:
        # The ignores: faiss's stubs (faiss/__init__.pyi) lack SearchParametersHNSW and the keyword arguments that
        # SWIG's constructors of parameter objects take.
        t = self.config.index_type
        if t in ("hnsw", "cagra"):
            ef = params.get("ef") if t == "hnsw" else params.get("itopk_size")
            return faiss.SearchParametersHNSW(efSearch=max(k, int(ef or 64)), sel=selector), k  # type: ignore[attr-defined]
        if t == "ivf_flat":
            return faiss.SearchParametersIVF(nprobe=int(params.get("n_probes", 20)), sel=selector), k  # type: ignore[call-arg]
        if t == "ivf_pq":
            ratio = float(params.get("refine_ratio", 2.0))
            inner = faiss.SearchParametersIVF(nprobe=int(params.get("n_probes", 20)), sel=selector)  # type: ignore[call-arg]
            return faiss.IndexRefineSearchParameters(k_factor=ratio, base_index_params=inner), k  # type: ignore[call-arg]
        return (faiss.SearchParameters(sel=selector) if selector is not None else None), k  # type: ignore[call-arg]

    def search(self, queries: np.ndarray, k: int, params: dict[str, Any],
               keep: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        filtered = None  # a local: its bitmap stays alive while FAISS reads it, whatever other searches cache
        if keep is not None:
            # A filter's mask is reused by every search with that filter until the collection changes (the
            # planner's FilterCache): its bitmap and parameters are made once for it (packing 100,000 rows and
            # making the objects cost about as much as a small search). The entry holds the mask, so no other
            # array can take its id meanwhile.
            base = keep if keep.base is None else keep.base
            shape = (len(keep), k, *sorted(params.items()))
            filtered = self._filtered
            if filtered is None or filtered[0] is not base or filtered[1] != shape:
                bitmap = np.packbits(keep[: self.size], bitorder="little")
                # faiss's Python wrapper takes the bitmap array alone; its stubs know only the SWIG (n, bitmap) form
                selector = faiss.IDSelectorBitmap(bitmap)  # type: ignore[call-arg, arg-type]
                filtered = (base, shape, bitmap, self._search_parameters(k, params, selector))
                self._filtered = filtered
            search_params, kk = filtered[3]
        else:
            key = (k, *sorted(params.items()))
            cached = self._unfiltered.get(key)
            if cached is None:
                if len(self._unfiltered) >= 256:
                    self._unfiltered.clear()
                cached = self._unfiltered[key] = self._search_parameters(k, params, None)
            search_params, kk = cached
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        _use_threads(len(queries), self.threads)
        if search_params is None:
            scores, rows = self.index.search(queries, kk)
        else:
            scores, rows = self.index.search(queries, kk, params=search_params)
        return scores, rows


class FaissBackend:
    """Keeps collections resident in RAM as FAISS indexes (the IndexBackend protocol of resident.py)."""

    name = "faiss"
    kind = "cpu"

    def __init__(self, threads: int | None = None, huge_pages: bool = True) -> None:
        self.threads = threads  # OpenMP threads per search or add (builds take every core); None: every core
        self.huge_pages = huge_pages

    def build(self, config: IndexConfig, vectors: np.ndarray) -> FaissIndex:
        return FaissIndex.build(config, vectors, self.threads, self.huge_pages)

    def load(self, config: IndexConfig, data: bytes) -> FaissIndex:
        return FaissIndex.from_bytes(config, data, self.threads, self.huge_pages)
