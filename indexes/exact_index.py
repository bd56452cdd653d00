"""Exact (brute-force) search on the array API: the GPU vector engine wherever CuPy runs, numpy in CI.

Written once for `xp` = cupy (vectors resident on the device) or numpy. The rows live in one padded buffer that
grows by doubling; a per-row `base` vector carries each row's squared norm (l2) or 0 (dot products) and +inf for
rows that must never be returned (dead rows, padding, a filter's excluded rows), so one matrix product and one
subtraction give every query's keys (smaller is closer) with exclusions already applied. The top-k of each query
is exact: its k smallest keys lie within the k chunks (of `chunk` consecutive rows) whose minima are smallest, so
only k * chunk candidates are sorted instead of every row (argument and measurements: docs/design/vectors.md#the-
exact-array-engine). Results are host numpy in engine space (squared L2 or the dot product), missing rows -1.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import struct
from typing import Any

import numpy as np

from .ann import IndexConfig
from .distance import uses_inner_product

FORMAT_MAGIC = b"SWEXACT1"
ALIGN_ROWS = 1024  # the buffer's rows are a multiple of this, so every power-of-two chunk up to it divides them
MIN_CHUNK, MAX_CHUNK = 32, 1024
SCORE_BLOCK_BYTES = 512 << 20  # keys of at most this many bytes at once: queries are searched in blocks
FULL_SORT_ROWS = 16_384  # below this many rows (or where chunks would not prune) every key is sorted


def cupy_version() -> str | None:
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def _cupy() -> Any:
    import cupy

    return cupy


def host(array: Any) -> np.ndarray:
    get = getattr(array, "get", None)
    return get() if callable(get) and not isinstance(array, np.ndarray) else np.asarray(array)


def chunk_for(rows: int, k: int) -> int:
    """Rows per chunk: about sqrt(rows / k), so that sorting the chunk minima and the k * chunk candidates cost
    about the same; a power of two within [MIN_CHUNK, MAX_CHUNK]."""
    target = math.sqrt(max(rows, 1) / max(k, 1))
    return int(min(MAX_CHUNK, max(MIN_CHUNK, 1 << max(0, round(math.log2(max(target, 1)))))))


def stable_argsort(xp: Any, a: Any) -> Any:
    """argsort along the last axis, stable: numpy is asked for it; CuPy's sort always is (and accepts no `kind` in
    older releases)."""
    return np.argsort(a, axis=-1, kind="stable") if xp is np else xp.argsort(a, axis=-1)


@functools.lru_cache(maxsize=64)
def _arange(xp: Any, n: int, step: int = 1) -> Any:
    """0, step, .. (n-1)*step as int64, made once per (module, n, step): a small search should launch few kernels."""
    return xp.arange(0, n * step, step, dtype=xp.int64)


def _take_rows(xp: Any, a: Any, index: Any) -> Any:
    """a[i, index[i, j]] for a 2-d `a`: one flat gather (CuPy's take_along_axis builds broadcast index arrays)."""
    if a.shape[0] == 1:
        return a.reshape(-1).take(index)
    return a.reshape(-1).take(index + _arange(xp, a.shape[0], a.shape[1])[:, None])


def smallest_k(xp: Any, keys: Any, k: int, full_sort_rows: int = FULL_SORT_ROWS) -> tuple[Any, Any]:
    """Per row of `keys` (b, n; n a multiple of MAX_CHUNK when n >= full_sort_rows), the k smallest keys and their
    columns, ascending. Exact: see the module's note for why the chunk step loses nothing. Equal keys at the k-th
    place are broken by column where every key is sorted, else by chunk (deterministically either way)."""
    b, n = keys.shape
    k = min(k, n)
    chunk = chunk_for(n, k)
    if n < full_sort_rows or k * chunk * 4 > n or n % chunk:
        order = stable_argsort(xp, keys)[:, :k]
        return _take_rows(xp, keys, order), order
    groups = n // chunk
    minima = keys.reshape(b, groups, chunk).min(axis=2)
    chosen = stable_argsort(xp, minima)[:, :k]  # the k chunks with the smallest minima
    columns = (chosen[:, :, None] * chunk + _arange(xp, chunk)[None, None, :]).reshape(b, k * chunk)
    candidates = _take_rows(xp, keys, columns)
    order = stable_argsort(xp, candidates)[:, :k]
    return _take_rows(xp, candidates, order), _take_rows(xp, columns, order)


class ExactArrayIndex:
    """Rows 0..size-1 of a collection, searched exactly with `xp` (the AnnIndex protocol of ann.py). Whatever
    index type is configured, answers are exact: search parameters are accepted and ignored."""

    engine = "exact"
    exact = True  # resident_search.py: every plan, filtered ones included, runs on this index
    supports_add = True
    supports_filter = True

    def __init__(self, config: IndexConfig, xp: Any, vectors: np.ndarray | None = None,
                 score_block_bytes: int = SCORE_BLOCK_BYTES, full_sort_rows: int = FULL_SORT_ROWS) -> None:
        self.config = config
        self.xp = xp
        self.ip = uses_inner_product(config.metric)
        self.score_block_bytes, self.full_sort_rows = score_block_bytes, full_sort_rows
        self._size = 0
        self.n_dead = 0
        self._data = xp.zeros((0, config.dim), dtype=xp.float32)  # rows: a multiple of ALIGN_ROWS
        self._base = xp.zeros(0, dtype=xp.float32)  # per row: norm (l2) or 0, +inf where never returned
        self._alive: np.ndarray = np.zeros(0, dtype=bool)  # host: which rows are dead (mark_dead)
        self._filtered: tuple[Any, int, Any] | None = None  # (mask, size, base with the filter) of the last filter
        self.searches = 0  # engine calls (one per micro-batch)
        if vectors is not None and len(vectors):
            self.add(vectors)

    # -- rows ------------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._size

    @property
    def device_bytes(self) -> int:
        return int(self._data.nbytes + self._base.nbytes)

    def _row_base(self, rows: Any) -> Any:
        xp = self.xp
        if self.ip:
            return xp.zeros(rows.shape[0], dtype=xp.float32)
        return xp.sum(rows * rows, axis=1, dtype=xp.float32)

    def add(self, vectors: np.ndarray) -> None:
        """Append rows (one upload of just these rows; the buffer doubles when full)."""
        xp = self.xp
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        n = len(vectors)
        if n == 0:
            return
        start, end = self._size, self._size + n
        if end > self._data.shape[0]:
            capacity = max(end, 2 * self._data.shape[0])
            capacity = -(-capacity // ALIGN_ROWS) * ALIGN_ROWS
            data = xp.zeros((capacity, self.config.dim), dtype=xp.float32)
            data[:start] = self._data[:start]
            base = xp.full(capacity, xp.inf, dtype=xp.float32)
            base[:start] = self._base[:start]
            self._data, self._base = data, base
        rows = xp.asarray(vectors)
        self._data[start:end] = rows
        self._base[start:end] = self._row_base(rows)
        self._alive = np.concatenate([self._alive[:start], np.ones(n, dtype=bool)])
        self._size = end
        self._filtered = None

    def mark_dead(self, rows: np.ndarray) -> None:
        """Rows deleted or replaced: their base becomes +inf on the device, so no search returns them."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = np.unique(rows[(rows >= 0) & (rows < self._size)])
        rows = rows[self._alive[rows]]
        if len(rows) == 0:
            return
        self._alive[rows] = False
        self.n_dead += len(rows)
        self._base[self.xp.asarray(rows)] = self.xp.inf
        self._filtered = None

    def copy_for_growth(self) -> "ExactArrayIndex":
        """A copy to add rows to (adding rows to an exact index is what building it over all of them does)."""
        copy = ExactArrayIndex(self.config, self.xp, score_block_bytes=self.score_block_bytes,
                               full_sort_rows=self.full_sort_rows)
        copy._data, copy._base = self._data.copy(), self._base.copy()
        copy._alive, copy._size, copy.n_dead = self._alive.copy(), self._size, self.n_dead
        return copy

    # -- search ----------------------------------------------------------------------------------------
    def _base_for(self, keep: np.ndarray | None) -> Any:
        """The base with a filter's excluded rows at +inf: one upload of the packed mask per filter, kept while the
        same mask comes back (the planner's filter cache reuses it until the collection changes)."""
        if keep is None:
            return self._base
        source = keep if keep.base is None else keep.base
        cached = self._filtered
        if cached is not None and cached[0] is source and cached[1] == len(keep):
            return cached[2]
        xp = self.xp
        n = min(len(keep), self._size)
        bits = xp.asarray(np.packbits(np.asarray(keep[:n], dtype=bool), bitorder="little"))
        mask = xp.unpackbits(bits, bitorder="little")[:n].astype(bool)
        base = self._base.copy()
        base[:n] = xp.where(mask, base[:n], xp.float32(xp.inf))
        base[n:self._size] = xp.inf
        self._filtered = (source, len(keep), base)
        return base

    def search(self, queries: np.ndarray, k: int, params: dict[str, Any],
               keep: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        xp = self.xp
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        nq, k = len(queries), int(k)
        worst = np.float32(-np.inf if self.ip else np.inf)
        out_scores = np.full((nq, k), worst, dtype=np.float32)
        out_rows = np.full((nq, k), -1, dtype=np.int64)
        if nq == 0 or k <= 0 or self._size == 0:
            return out_scores, out_rows
        self.searches += 1
        width = -(-self._size // ALIGN_ROWS) * ALIGN_ROWS  # padded rows: base +inf beyond size
        data, base = self._data[:width], self._base_for(keep)[:width]
        take = min(k, width)
        block = max(1, self.score_block_bytes // (4 * width))
        q_all = xp.asarray(queries)
        for s in range(0, nq, block):
            q = q_all[s:s + block]
            keys = q @ data.T  # (b, width): the dot products, turned into keys in place
            keys *= xp.float32(-1.0 if self.ip else -2.0)
            keys += base[None, :]
            best, rows = smallest_k(xp, keys, take, self.full_sort_rows)
            best_h, rows_h = host(best), host(rows).astype(np.int64, copy=False)
            missing = ~np.isfinite(best_h) | (rows_h >= self._size)
            if self.ip:
                best_h = -best_h
            else:  # the queries' own squared norms, added on the host: three fewer kernels for a small search
                norms = np.einsum("ij,ij->i", queries[s:s + len(q)], queries[s:s + len(q)])
                best_h = np.maximum(best_h + norms[:, None], 0)
            out_scores[s:s + len(q), :take] = np.where(missing, worst, best_h)
            out_rows[s:s + len(q), :take] = np.where(missing, -1, rows_h)
        return out_scores, out_rows

    # -- persistence -----------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The rows, as the FAISS flat index serialises them (dead rows included: resident.py marks them again)."""
        header = struct.pack("<8sqq", FORMAT_MAGIC, self._size, self.config.dim)
        return header + host(self._data[:self._size]).astype("<f4", copy=False).tobytes()

    @classmethod
    def from_bytes(cls, config: IndexConfig, xp: Any, data: bytes) -> "ExactArrayIndex":
        magic, size, dim = struct.unpack_from("<8sqq", data)
        if magic != FORMAT_MAGIC or dim != config.dim:
            raise ValueError("not an exact array index of this collection's dimension")
        offset = struct.calcsize("<8sqq")
        vectors = np.frombuffer(data, dtype="<f4", count=size * dim, offset=offset).reshape(size, dim)
        return cls(config, xp, vectors)

    def warm_up(self) -> None:
        """Run each code path once (CuPy compiles a kernel at its first use): the full sort and the chunked one,
        with and without a filter."""
        rng = np.random.default_rng(0)
        queries = rng.normal(size=(3, self.config.dim)).astype(np.float32)
        keep = np.ones(self._size, dtype=bool)
        keep[::2] = False
        for k in (1, 10, 100):
            self.search(queries[:1], k, {}, None)
            self.search(queries, k, {}, keep)


class ExactArrayBackend:
    """Keeps collections resident as ExactArrayIndex (the IndexBackend protocol of resident.py): with CuPy on a
    CUDA device (the `gpu` kind where cuVS is not installed), or numpy (tests)."""

    kind = "gpu"
    trains = False  # any configured type is built at once over any number of rows (resident.py)

    def __init__(self, xp: Any = None) -> None:
        self.xp = xp if xp is not None else _cupy()
        self.name = "cupy" if self.xp.__name__ == "cupy" else f"exact-{self.xp.__name__}"

    def build(self, config: IndexConfig, vectors: np.ndarray) -> ExactArrayIndex:
        return ExactArrayIndex(config, self.xp, vectors)

    def load(self, config: IndexConfig, data: bytes) -> ExactArrayIndex:
        return ExactArrayIndex.from_bytes(config, self.xp, data)

    def warm_up(self, dim: int = 64) -> None:
        """Compile what a first search would (see ExactArrayIndex.warm_up) for each metric's path, on a buffer
        large enough for the chunked top-k."""
        rng = np.random.default_rng(0)
        rows = rng.normal(size=(2 * FULL_SORT_ROWS, dim)).astype(np.float32)
        for metric in ("l2", "inner_product"):
            index = self.build(IndexConfig("brute_force", metric, dim, {}), rows)
            index.mark_dead(np.arange(0, 100, 3))
            index.warm_up()
