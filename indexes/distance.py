"""One distance convention for every engine, and exact search written once over an array namespace.

Responses always carry distances where smaller is closer:
  l2            -> Euclidean distance            (pgvector <->; FAISS/cuVS return it squared)
  cosine        -> 1 - cosine similarity         (pgvector <=>; resident indexes store unit vectors, use dot)
  inner_product -> minus the dot product         (pgvector <#>; FAISS/cuVS return +dot, larger is closer)

`xp` is numpy here and cupy on a GPU; the code below uses only what both provide.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

METRICS = ("l2", "cosine", "inner_product")
# The most bytes of scores a masked exact search on the host holds at once (queries x rows x float32; its
# temporaries make its peak a few times this): a batch of 10,000 queries over 20,000 rows once took 2.3 GB.
HOST_SCORE_BLOCK_BYTES = 16 << 20


def uses_inner_product(metric: str) -> bool:
    """Resident indexes search cosine as inner product over unit vectors."""
    return metric in ("cosine", "inner_product")


def prepare(xp: Any, vectors: Any, metric: str) -> Any:
    """What a resident index stores and searches with: unit vectors for cosine, the vectors otherwise."""
    vectors = xp.ascontiguousarray(vectors, dtype=xp.float32)
    if metric != "cosine":
        return vectors
    norms = xp.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / xp.where(norms == 0, 1, norms)


def from_engine(xp: Any, raw: Any, metric: str) -> Any:
    """Convert what FAISS / cuVS return (squared L2, or dot product) to the response convention."""
    if metric == "l2":
        return xp.sqrt(xp.maximum(raw, 0))
    if metric == "cosine":
        return 1 - raw
    return -raw


def scores(xp: Any, data: Any, queries: Any, metric: str) -> Any:
    """Engine-space scores, (nq, n): squared L2 (ascending is closer) or dot product (descending)."""
    dots = queries @ data.T
    if uses_inner_product(metric):
        return dots
    sq_data = xp.sum(data * data, axis=1)
    sq_queries = xp.sum(queries * queries, axis=1)
    return xp.maximum(sq_queries[:, None] - 2 * dots + sq_data[None, :], 0)


def exact_search(xp: Any, data: Any, queries: Any, k: int, metric: str, keep: Any = None,
                 threads: int = 1) -> tuple[Any, Any]:
    """Exact top-k over prepared `data` rows: (engine-space scores, row numbers), row -1 where fewer than k.

    `keep` is an optional boolean mask over rows; rows where it is False are never returned. On the host, memory
    stays bounded whatever queries x rows: without a mask, FAISS's brute force with `threads` OpenMP threads
    (blocks of 4,096 queries x 1,024 rows, the GIL released: docs/design/serving.md); with one, blocks of queries.
    """
    nq, n = queries.shape[0], data.shape[0]
    ip = uses_inner_product(metric)
    if xp is np and 0 < k and 0 < n:
        if keep is None:
            return _cpu_knn(data, queries, k, ip, threads)
        step = max(1, HOST_SCORE_BLOCK_BYTES // (4 * n))
        if nq > step:
            parts = [exact_search(xp, data, queries[i:i + step], k, metric, keep) for i in range(0, nq, step)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    worst = -xp.inf if ip else xp.inf
    out_scores = xp.full((nq, k), worst, dtype=xp.float32)
    out_rows = xp.full((nq, k), -1, dtype=xp.int64)
    if n == 0 or k == 0:
        return out_scores, out_rows
    s = scores(xp, data, queries, metric).astype(xp.float32)
    if keep is not None:
        s = xp.where(keep[None, :], s, worst)
    order_key = -s if ip else s
    take = min(k, n)
    if take < n:
        part = xp.argpartition(order_key, take - 1, axis=1)[:, :take]
    else:
        part = xp.broadcast_to(xp.arange(n), (nq, n))
    part_keys = xp.take_along_axis(order_key, part, axis=1)
    order = xp.argsort(part_keys, axis=1, kind="stable")
    rows = xp.take_along_axis(part, order, axis=1)
    best = xp.take_along_axis(s, rows, axis=1)
    valid = xp.isfinite(best)
    out_scores[:, :take] = best
    out_rows[:, :take] = xp.where(valid, rows, -1)
    return out_scores, out_rows


_omp = threading.local()


def omp_threads(n: int) -> None:
    """faiss.omp_set_num_threads(n) for the calling thread (OpenMP's setting is per thread), skipped when it is
    already n: the call crosses SWIG, and a small search makes it every time."""
    if getattr(_omp, "threads", None) != n:
        import faiss

        faiss.omp_set_num_threads(n)
        _omp.threads = n


def blas_threads(n: int) -> None:
    """At most n threads for numpy's BLAS (pthreads OpenBLAS: one setting for the whole process), whose matrix
    products (exact search over many queries: recall) otherwise take every core, the event loop's included. A BLAS
    on OpenMP (FAISS's own) follows the calling thread's OpenMP setting, which omp_threads makes per call."""
    from threadpoolctl import ThreadpoolController

    for lib in ThreadpoolController().lib_controllers:
        info = lib.info()
        if info["user_api"] == "blas" and info.get("threading_layer") != "openmp":
            lib.set_num_threads(n)


def _cpu_knn(data: np.ndarray, queries: np.ndarray, k: int, ip: bool,
             threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """FAISS's exact k-NN on the CPU, GIL released: SIMD distance loops for a few queries, blocks of 4,096 queries x
    1,024 rows through its BLAS for more, so no queries x rows temporaries. numpy's matrix product here went to
    multithreaded OpenBLAS, which collapses when several threads call it at once (measured: 32 threads,
    10,000 x 128 rows, one query each: 88 searches/s against 2,300 with FAISS)."""
    import faiss

    # One OpenMP thread unless told (the setting is per calling thread): split over two, one query of
    # 10,000 x 128 rows took 330 us of CPU and 165 us of wall time, against 58 us on one.
    omp_threads(threads)
    q, x = np.ascontiguousarray(queries, dtype=np.float32), np.ascontiguousarray(data, dtype=np.float32)
    scores, rows = np.empty((len(q), k), np.float32), np.empty((len(q), k), np.int64)
    # faiss.knn without its wrapper (microseconds, and a small filtered search is about ten): the same two calls
    (faiss.knn_inner_product if ip else faiss.knn_L2sqr)(faiss.swig_ptr(q), faiss.swig_ptr(x), q.shape[1], len(q),
                                                         len(x), k, faiss.swig_ptr(scores), faiss.swig_ptr(rows))
    scores[rows < 0] = -np.inf if ip else np.inf
    return scores, rows


def merge_topk(xp: Any, metric: str, k: int, *parts: tuple[Any, Any]) -> tuple[Any, Any]:
    """Merge several (scores, rows) candidate lists for the same queries into one top-k."""
    s = xp.concatenate([p[0] for p in parts], axis=1)
    r = xp.concatenate([p[1] for p in parts], axis=1)
    ip = uses_inner_product(metric)
    key = xp.where(r < 0, xp.inf, -s if ip else s)
    order = xp.argsort(key, axis=1, kind="stable")[:, :k]
    return xp.take_along_axis(s, order, axis=1), xp.take_along_axis(r, order, axis=1)


def to_numpy(array: Any) -> np.ndarray:
    """Host copy of a numpy or cupy array."""
    get = getattr(array, "get", None)
    return get() if callable(get) else np.asarray(array)
