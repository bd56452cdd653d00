"""cuVS (GPU) indexes: brute force, IVF-Flat, IVF-PQ with exact re-ranking, and CAGRA (also serving `hnsw`).

The one module that calls cuVS; FAISS's twin is indexes/faiss_index.py (same class and method names). Rows are
numbered 0..size-1 in insertion order; results are host NumPy in engine space (squared L2, or the dot product),
missing results row -1, every slot pre-filled and checked on the host. cupy and cuvs are imported on first use.

Threads: cuVS's Python layer is not thread-safe (NVIDIA/cuvs #2041). Every call must come from ONE thread, the
single-worker GPU executor of indexes/manager.py: do not call into this module from anywhere else. Large builds run
in a child process (indexes/build_process.py). Signatures follow the cuVS Python sources (NVIDIA/cuvs tag v26.08.01,
python/cuvs/cuvs/...); each call cites its file below. More: docs/design/vectors.md#cuvs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import struct
import tempfile
from types import SimpleNamespace
from typing import Any

import numpy as np

from .ann import IndexConfig, default_n_lists, default_pq_dim
from .build_process import DetachedBuilder
from .distance import uses_inner_product

DISTRIBUTION = "cuvs-cu12"
KINDS = ("brute_force", "ivf_flat", "ivf_pq", "cagra")
FORMAT_MAGIC = b"SWCUVS01"  # our container around cuVS's own index file (see to_bytes)
CAGRA_EXACT_FACTOR = 2  # CAGRA over <= 2*graph_degree rows is a near-complete graph: serve it exactly instead
# cuVS's refine selects its top k with raft's warp sort, which holds at most 256 (k > 256 fails). IVF-PQ re-ranks
# more candidates than that at k >= 129 with the default refine_ratio, and whenever resident.py over-fetches past
# deleted rows or a filter: those re-rank with the array-namespace `rerank` instead (same scores, on the device).
REFINE_MAX_K = 256
RERANK_CHUNK_BYTES = 1 << 28  # gathered candidate vectors per step of `rerank`
MAX_OVERFETCH = 4096  # IVF-PQ (no filter argument) fetches past at most this many dead rows, as resident.py does


@functools.lru_cache(maxsize=1)
def _version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def __getattr__(name: str) -> Any:
    """Module attribute VERSION, looked up lazily (PEP 562)."""
    if name == "VERSION":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=1)
def _lib() -> SimpleNamespace:
    """cupy, the cuVS modules this file uses, and the one shared Resources handle (imported on first use)."""
    import cupy

    # NVIDIA/cuvs python/cuvs/cuvs/tests/test_serialization.py: `from cuvs.common import make_device_padded_dataset`
    # NVIDIA/cuvs python/cuvs/cuvs/common/resources.pyx: Resources(stream=None); .sync()
    from cuvs.common import Resources, make_device_padded_dataset

    # NVIDIA/cuvs python/cuvs/cuvs/neighbors/__init__.py: the modules, and `from .refine import refine` (a function)
    from cuvs.neighbors import brute_force, cagra, filters, ivf_flat, ivf_pq, refine

    return SimpleNamespace(cp=cupy, resources=Resources(), make_device_padded_dataset=make_device_padded_dataset,
                           brute_force=brute_force, cagra=cagra, filters=filters, ivf_flat=ivf_flat,
                           ivf_pq=ivf_pq, refine=refine)


def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a cuVS function with the shared Resources and wait for it. Every public cuVS function takes
    `resources=`; when one is passed its work is asynchronous until `.sync()` (common/resources.pyx,
    auto_sync_resources)."""
    lib = _lib()
    out = fn(*args, resources=lib.resources, **kwargs)
    lib.resources.sync()
    return out


# -- pure helpers (no GPU needed) -------------------------------------------------------------------------
def engine_kind(index_type: str) -> str:
    """The cuVS index that serves an index type: `hnsw` is served by CAGRA on the GPU."""
    if index_type == "hnsw":
        return "cagra"
    if index_type in KINDS:
        return index_type
    raise ValueError(f"cuVS has no index type {index_type!r}")


def cuvs_metric(metric: str) -> str:
    # cuvs/distance/distance.pyx names; "sqeuclidean" is squared L2, "inner_product" the raw dot product.
    return "inner_product" if uses_inner_product(metric) else "sqeuclidean"


def cagra_degrees(config: IndexConfig) -> tuple[int, int]:
    """(graph_degree, intermediate_graph_degree) as configured; hnsw's m maps to graph_degree = 2*m."""
    p = config.params
    if config.index_type == "hnsw":
        graph = 2 * int(p.get("m") or 32)
        return graph, 2 * graph
    return int(p.get("graph_degree") or 64), int(p.get("intermediate_graph_degree") or 128)


def keep_bitset(keep: np.ndarray, size: int) -> np.ndarray:
    """cuVS keep-bitset over rows 0..size-1: bit i set = row i may be returned; LSB-first in little-endian uint32
    words, ceil(size/32) of them (filters.from_bitset; decoded the same way by cuVS's tests/ann_utils.py)."""
    packed = np.packbits(_fit_mask(keep, size), bitorder="little")
    pad = (-len(packed)) % 4
    if pad:
        packed = np.concatenate([packed, np.zeros(pad, dtype=np.uint8)])
    return packed.view(np.dtype("<u4"))


def _fit_mask(keep: np.ndarray, size: int) -> np.ndarray:
    keep = np.asarray(keep, dtype=bool)
    if len(keep) == size:
        return keep
    out = np.zeros(size, dtype=bool)
    out[: min(len(keep), size)] = keep[:size]
    return out


def _worst(ip: bool) -> float:
    return -np.inf if ip else np.inf


def _empty(nq: int, k: int, ip: bool) -> tuple[np.ndarray, np.ndarray]:
    return np.full((nq, k), _worst(ip), dtype=np.float32), np.full((nq, k), -1, dtype=np.int64)


def _duplicates(rows: np.ndarray) -> np.ndarray:
    """Later repeats of a row within each query (refine can repeat a candidate it was given twice)."""
    order = np.argsort(rows, axis=1, kind="stable")
    ordered = np.take_along_axis(rows, order, axis=1)
    repeat = np.zeros(rows.shape, dtype=bool)
    repeat[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    out = np.empty_like(repeat)
    np.put_along_axis(out, order, repeat, axis=1)
    return out


def finish(scores: np.ndarray, rows: np.ndarray, k: int, size: int, keep: np.ndarray | None, ip: bool,
           dedupe: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cuVS output -> the AnnIndex contract: (nq, k) float32 scores and int64 rows, best first, row -1 (worst
    score) for anything out of range (unwritten slots, CAGRA's uint32 sentinel), excluded by `keep`, or repeated."""
    rows = np.asarray(rows).astype(np.int64, copy=False)
    scores = np.asarray(scores, dtype=np.float32)
    bad = (rows < 0) | (rows >= size)
    if keep is not None:
        bad |= ~keep[np.clip(rows, 0, max(size - 1, 0))]
    rows = np.where(bad, -1, rows)
    if dedupe:
        bad |= _duplicates(rows)
        rows = np.where(bad, -1, rows)
    scores = np.where(bad, np.float32(_worst(ip)), scores).astype(np.float32)
    key = np.where(bad, np.inf, -scores if ip else scores)
    order = np.argsort(key, axis=1, kind="stable")
    scores, rows = np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)
    if rows.shape[1] < k:
        pad_s, pad_r = _empty(len(rows), k - rows.shape[1], ip)
        scores, rows = np.concatenate([scores, pad_s], axis=1), np.concatenate([rows, pad_r], axis=1)
    return np.ascontiguousarray(scores[:, :k]), np.ascontiguousarray(rows[:, :k])


def rerank(xp: Any, dataset: Any, queries: Any, candidates: Any, ip: bool,
           chunk_bytes: int = RERANK_CHUNK_BYTES) -> tuple[Any, Any]:
    """Exact engine-space scores (squared L2, or the dot product when `ip`) of each query's candidate rows, in the
    candidates' order: what cuVS's refine computes, for any number of candidates. Rows outside the dataset (-1)
    score worst. `xp` is cupy on the GPU (numpy in the tests); queries are gathered in steps of `chunk_bytes`."""
    nq, k0 = candidates.shape
    dim = dataset.shape[1]
    step = max(1, chunk_bytes // max(1, k0 * dim * 4))
    out = xp.empty((nq, k0), dtype=xp.float32)
    for s in range(0, nq, step):
        c = candidates[s: s + step]
        valid = (c >= 0) & (c < dataset.shape[0])
        vectors = dataset[xp.where(valid, c, 0)]  # (b, k0, dim)
        q = queries[s: s + step]
        if ip:
            scored = xp.einsum("bkd,bd->bk", vectors, q)
        else:
            diff = vectors - q[:, None, :]
            scored = xp.einsum("bkd,bkd->bk", diff, diff)
        out[s: s + step] = xp.where(valid, scored, xp.float32(_worst(ip)))
    return out, xp.where((candidates >= 0) & (candidates < dataset.shape[0]), candidates, -1)


def _pack(header: dict[str, Any], sections: dict[str, bytes]) -> bytes:
    header = dict(header, sections=[[name, len(blob)] for name, blob in sections.items()])
    head = json.dumps(header, sort_keys=True).encode()
    return b"".join([FORMAT_MAGIC, struct.pack("<Q", len(head)), head, *sections.values()])


def _unpack(data: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    view = memoryview(data)
    start = len(FORMAT_MAGIC) + 8
    if bytes(view[: len(FORMAT_MAGIC)]) != FORMAT_MAGIC or len(view) < start:
        raise ValueError("not a Switchyard cuVS index")
    (head_len,) = struct.unpack("<Q", view[len(FORMAT_MAGIC): start])
    header = json.loads(bytes(view[start: start + head_len]))
    offset, sections = start + head_len, {}
    for name, length in header["sections"]:
        sections[name] = bytes(view[offset: offset + length])
        offset += length
    if offset != len(view):
        raise ValueError("truncated or oversized cuVS index data")
    return header, sections


# -- the index --------------------------------------------------------------------------------------------
class CuvsIndex:
    engine = "cuvs"
    supports_add = False  # set per instance in __init__
    supports_filter = False

    def __init__(self, config: IndexConfig, kind: str, index: Any, size: int, *, dataset: Any = None,
                 n_lists: int | None = None, keepalive: list[Any] | None = None) -> None:
        self.config = config
        self.kind = kind  # the cuVS index actually held (CAGRA for "hnsw"; brute force for a tiny CAGRA)
        self.index = index
        self._size = size
        # Device rows 0..size-1. brute_force: the C++ index only references a device dataset, so this keeps
        # it alive; ivf_pq: raw vectors for exact re-ranking; cagra: old rows for extend's old+new dataset.
        self._dataset = dataset
        self._n_lists = n_lists
        self._keepalive = keepalive or []  # cuVS Dataset handles the index reads
        self._bitset: Any = None  # the device keep-bitset of the current search, kept alive while cuVS reads it
        # Deleted rows, resident: a host mask and its device keep-bitset, updated word by word per delete
        # (mark_dead) instead of packed and uploaded on every search. None while no row is dead.
        self._alive: np.ndarray | None = None
        self._alive_words: np.ndarray | None = None  # host copy of the device bitset
        self._alive_bits: Any = None
        self.n_dead = 0
        # brute_force has no extend (appended rows stay in resident.py's exact delta); IVF-PQ has no filter
        # argument in the Python/C API (resident.py over-fetches instead).
        self.supports_add = kind in ("ivf_flat", "ivf_pq", "cagra")
        self.supports_filter = kind in ("brute_force", "ivf_flat", "cagra")
        self.wide_reranks = 0  # IVF-PQ searches re-ranked by `rerank`: more candidates than refine takes
        # Small writes gather in resident.py's exact delta and join in one add of at least this many rows: CAGRA's
        # extend copies the whole device dataset per call, IVF-PQ's add copies the raw vectors it re-ranks with.
        self.add_batch_rows = {"cagra": 1024, "ivf_pq": 256}.get(kind, 1)

    @classmethod
    def build(cls, config: IndexConfig, vectors: np.ndarray) -> "CuvsIndex":
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        n, kind, metric, p = len(vectors), engine_kind(config.index_type), cuvs_metric(config.metric), config.params
        if n == 0:
            raise ValueError("a cuVS index needs at least one vector")
        lib = _lib()
        data = lib.cp.asarray(vectors)  # every GPU build below takes device memory (vector.md 1.1 table)
        if kind == "cagra":
            graph, intermediate = cagra_degrees(config)
            if n <= CAGRA_EXACT_FACTOR * graph:
                kind = "brute_force"
        if kind == "brute_force":
            # cuvs/neighbors/brute_force/brute_force.pyx: build(dataset, metric="sqeuclidean", metric_arg=2.0,
            # resources=None) -> Index
            index = _run(lib.brute_force.build, data, metric=metric)
            return cls(config, kind, index, n, dataset=data)
        if kind in ("ivf_flat", "ivf_pq"):
            n_lists = max(1, min(int(p.get("n_lists") or default_n_lists(n)), n))
            if kind == "ivf_flat":
                # NVIDIA/cuvs python/cuvs/cuvs/neighbors/ivf_flat/ivf_flat.pyx: IndexParams(*, n_lists=1024,
                # metric="sqeuclidean", metric_arg=2.0, kmeans_n_iters=20, kmeans_trainset_fraction=0.5,
                # adaptive_centers=False, add_data_on_build=True, conservative_memory_allocation=False);
                # build(index_params, dataset, resources=None) -> Index
                params = lib.ivf_flat.IndexParams(n_lists=n_lists, metric=metric, add_data_on_build=False)
                index = _run(lib.ivf_flat.build, params, data)
            else:
                # cuvs/neighbors/ivf_pq/ivf_pq.pyx: IndexParams(*, n_lists=1024, metric="sqeuclidean", ...,
                # pq_bits=8, pq_dim=0, ..., add_data_on_build=True, ...); build(index_params, dataset,
                # resources=None) -> Index
                pq_bits = int(p.get("pq_bits") or 8)
                params = lib.ivf_pq.IndexParams(n_lists=n_lists, metric=metric, pq_bits=pq_bits,
                                                pq_dim=int(p.get("pq_dim") or default_pq_dim(config.dim, pq_bits)),
                                                add_data_on_build=False)
                index = _run(lib.ivf_pq.build, params, data)
            built = cls(config, kind, index, 0, n_lists=n_lists)
            built._extend_ivf(data)  # trained empty, then filled with ids == row numbers
            return built
        graph, intermediate = cagra_degrees(config)
        intermediate = min(intermediate, n - 1)
        # NVIDIA/cuvs python/cuvs/cuvs/neighbors/cagra/cagra.pyx: IndexParams(*, metric="sqeuclidean",
        # intermediate_graph_degree=128, graph_degree=64, build_algo="ivf_pq", ...); build(index_params, dataset,
        # resources=None) -> Index (a device array is wrapped in a padded Dataset the Index keeps alive)
        params = lib.cagra.IndexParams(metric=metric, intermediate_graph_degree=intermediate,
                                       graph_degree=min(graph, intermediate))
        index = _run(lib.cagra.build, params, data)
        return cls(config, kind, index, n, dataset=data)

    @classmethod
    def from_bytes(cls, config: IndexConfig, data: bytes) -> "CuvsIndex":
        header, sections = _unpack(data)
        kind, size, dim = header["kind"], int(header["size"]), int(header["dim"])
        if dim != config.dim or header["metric"] != config.metric or kind not in KINDS:
            raise ValueError(f"cuVS index data is for a {kind} index of dim {dim} / {header['metric']}, "
                             f"not {config.index_type} of dim {config.dim} / {config.metric}")
        lib = _lib()
        keepalive: list[Any] = []
        with tempfile.TemporaryDirectory(prefix="switchyard-cuvs-") as tmp:
            path = os.path.join(tmp, "index.bin")
            with open(path, "wb") as f:
                f.write(sections["index"])
            if kind == "cagra":
                # 26.08 form (NVIDIA/cuvs cagra.pyx load(index, filename, out_dataset=None, resources=None), used so
                # in tests/test_serialization.py): fill a fresh Index; the Dataset receives and owns the vectors.
                index = lib.cagra.Index()
                owner = lib.cagra.Dataset()
                _run(lib.cagra.load, index, path, out_dataset=owner)
                keepalive.append(owner)
            else:
                # brute_force.pyx / ivf_flat.pyx / ivf_pq.pyx: load(filename, resources=None) -> Index (brute force's
                # deserialised index owns its dataset: cpp/src/neighbors/brute_force_serialize.cu)
                index = _run(getattr(lib, kind).load, path)
        dataset = None
        if "raw" in sections:
            dataset = lib.cp.asarray(np.frombuffer(sections["raw"], dtype=np.float32).reshape(size, dim))
        return cls(config, kind, index, size, dataset=dataset, n_lists=header.get("n_lists"), keepalive=keepalive)

    def to_bytes(self) -> bytes:
        """Our header + cuVS's own file (+ the raw vectors IVF-PQ re-ranks with and CAGRA extends from)."""
        lib = _lib()
        with tempfile.TemporaryDirectory(prefix="switchyard-cuvs-") as tmp:
            path = os.path.join(tmp, "index.bin")
            # save(filename, index, include_dataset=True, resources=None) in brute_force.pyx, ivf_flat.pyx,
            # ivf_pq.pyx and cagra.pyx (CAGRA writes graph + dataset with include_dataset=True)
            _run(getattr(lib, self.kind).save, path, self.index, include_dataset=True)
            with open(path, "rb") as f:
                sections = {"index": f.read()}
        if self.kind in ("ivf_pq", "cagra"):
            sections["raw"] = np.ascontiguousarray(lib.cp.asnumpy(self._dataset), dtype=np.float32).tobytes()
        header = {"format": 1, "kind": self.kind, "index_type": self.config.index_type, "metric": self.config.metric,
                  "dim": self.config.dim, "size": self._size, "n_lists": self._n_lists, "cuvs": _version()}
        return _pack(header, sections)

    @property
    def size(self) -> int:
        return self._size

    def mark_dead(self, rows: np.ndarray) -> None:
        """Rows deleted or replaced: searches never return them. Only the bitset words holding them are packed and
        sent to the device."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = np.unique(rows[(rows >= 0) & (rows < self._size)])
        if len(rows) == 0:
            return
        alive = self._alive
        first = alive is None
        if alive is None:
            alive = self._alive = np.ones(self._size, dtype=bool)
        self.n_dead += int(np.count_nonzero(alive[rows]))
        alive[rows] = False
        if first:
            self._upload_alive(alive)
            return
        assert self._alive_words is not None  # uploaded with the mask
        words = np.unique(rows >> 5)
        bits = np.arange(32) + 32 * words[:, None]
        in_words = alive[np.minimum(bits, self._size - 1)] & (bits < self._size)  # bits past the end: 0
        self._alive_words[words] = keep_bitset(in_words.ravel(), bits.size)
        self._alive_bits[_lib().cp.asarray(words)] = _lib().cp.asarray(self._alive_words[words])

    def _upload_alive(self, alive: np.ndarray) -> None:
        self._alive_words = keep_bitset(alive, self._size)
        self._alive_bits = _lib().cp.asarray(self._alive_words)

    def _grow_alive(self, added: int) -> None:
        """Rows appended by add are alive: the mask and bitset grow (one upload per batched add)."""
        if self._alive is not None:
            self._alive = np.concatenate([self._alive, np.ones(added, dtype=bool)])
            self._upload_alive(self._alive)

    def add(self, vectors: np.ndarray) -> None:
        if not self.supports_add:
            raise RuntimeError(f"cuVS {self.kind} cannot add rows: resident.py keeps them in the exact delta")
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if len(vectors) == 0:
            return
        lib = _lib()
        data = lib.cp.asarray(vectors)
        if self.kind in ("ivf_flat", "ivf_pq"):
            self._extend_ivf(data)
            return
        extended = lib.cp.concatenate([self._dataset, data])
        # NVIDIA/cuvs common/dataset.pyx: make_device_padded_dataset(dataset, resources=None) -> Dataset (owning
        # copy, or a view keeping `dataset` alive when its row stride already fits)
        padded = _run(lib.make_device_padded_dataset, extended)
        # NVIDIA/cuvs cagra.pyx (26.08): ExtendParams(*, max_chunk_size=None); extend(params, index,
        # extended_dataset, new_start_row, resources=None): old || new rows in one padded dataset, new_start_row
        # == current size; the index is rebound to (and keeps alive) the extended dataset.
        self.index = _run(lib.cagra.extend, lib.cagra.ExtendParams(), self.index, padded, self._size)
        self._dataset, self._keepalive = extended, [padded]
        self._size += len(vectors)
        self._grow_alive(len(vectors))

    def _extend_ivf(self, data: Any) -> None:
        lib = _lib()
        ids = lib.cp.arange(self._size, self._size + len(data), dtype=lib.cp.int64)
        # ivf_flat.pyx / ivf_pq.pyx: extend(index, new_vectors, new_indices, resources=None) -> Index; new_indices
        # int64 (n,), stored and returned by search as-is. IVF-Flat's C layer needs device arrays; both are here.
        self.index = _run(getattr(lib, self.kind).extend, self.index, data, ids)
        if self.kind == "ivf_pq":
            self._dataset = data if self._dataset is None else lib.cp.concatenate([self._dataset, data])
        self._size += len(data)
        self._grow_alive(len(data))

    def _n_probes(self, params: dict[str, Any]) -> int:
        n_probes = max(1, int(params.get("n_probes") or 20))
        return min(n_probes, self._n_lists) if self._n_lists else n_probes

    def search(self, queries: np.ndarray, k: int, params: dict[str, Any],
               keep: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        ip = uses_inner_product(self.config.metric)
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        nq, kk = len(queries), min(int(k), self._size)
        resident_keep = keep is None and self.n_dead > 0  # only the deletes: the resident bitset applies
        if keep is not None:
            keep = _fit_mask(keep, self._size)
            if self._alive is not None:
                keep = keep & self._alive
        elif resident_keep:
            keep = self._alive
        if nq == 0 or kk <= 0 or (keep is not None and (self.n_dead >= self._size if resident_keep
                                                        else not keep.any())):
            return _empty(nq, int(k), ip)
        lib = _lib()
        cp = lib.cp
        q = cp.asarray(queries)  # every GPU search needs device queries and outputs
        if self.kind == "ivf_pq":  # no filter argument: over-fetch past the dead rows, finish() drops them
            fetch = min(self._size, kk + min(self.n_dead, MAX_OVERFETCH)) if resident_keep else kk
            scores, rows = self._search_ivf_pq(q, fetch, params)
            return finish(scores, rows, int(k), self._size, keep, ip, dedupe=True)
        # Pre-filled outputs: search(..., neighbors=None, distances=None) accept (nq, k) buffers, int64 neighbors
        # for brute force / IVF, uint32 for CAGRA (whose empty slots then read 2**32-1, out of range).
        id_dtype = cp.uint32 if self.kind == "cagra" else cp.int64
        empty_id = np.iinfo(np.uint32).max if self.kind == "cagra" else -1
        neighbors = cp.full((nq, kk), empty_id, dtype=id_dtype)
        distances = cp.full((nq, kk), _worst(ip), dtype=cp.float32)
        prefilter = None
        if keep is not None and self.supports_filter:
            # resident after deletes; a payload filter's own bitset is uploaded per search
            self._bitset = self._alive_bits if resident_keep else cp.asarray(keep_bitset(keep, self._size))
            # cuvs/neighbors/filters/filters.pyx: from_bitset(bitset uint32, 1 = keep) -> Prefilter (holds the array)
            prefilter = lib.filters.from_bitset(self._bitset)
        if self.kind == "brute_force":
            # brute_force.pyx: search(index, queries, k, neighbors=None, distances=None, resources=None,
            # prefilter=None); NVIDIA/cuvs c/src/neighbors/brute_force.cpp accepts BITSET (one mask for all
            # queries, sized by the dataset) as well as BITMAP
            _run(lib.brute_force.search, self.index, q, kk, neighbors=neighbors, distances=distances,
                 prefilter=prefilter)
        elif self.kind == "ivf_flat":
            # ivf_flat.pyx: SearchParams(*, n_probes=20); search(search_params, index, queries, k, neighbors=None,
            # distances=None, resources=None, filter=None)
            _run(lib.ivf_flat.search, lib.ivf_flat.SearchParams(n_probes=self._n_probes(params)), self.index, q, kk,
                 neighbors=neighbors, distances=distances, filter=prefilter)
        else:
            # cagra.pyx: SearchParams(*, max_queries=0, itopk_size=64, ..., search_width=1, ...); search(
            # search_params, index, queries, k, neighbors=None, distances=None, resources=None, filter=None).
            # itopk_size must be >= k (vector.md 1.5: RAFT_EXPECTS(topk <= plan.itopk_size)).
            itopk = params.get("ef") if self.config.index_type == "hnsw" else params.get("itopk_size")
            search_params = lib.cagra.SearchParams(itopk_size=max(kk, int(itopk or 64)),
                                                   search_width=max(1, int(params.get("search_width") or 1)))
            _run(lib.cagra.search, search_params, self.index, q, kk, neighbors=neighbors, distances=distances,
                 filter=prefilter)
        return finish(cp.asnumpy(distances), cp.asnumpy(neighbors), int(k), self._size, keep, ip)

    def _search_ivf_pq(self, q: Any, kk: int, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Over-fetch kk*refine_ratio PQ candidates and re-rank them exactly against the raw device vectors
        (returns all of them, best first; finish() drops repeats and keeps k)."""
        lib = _lib()
        cp = lib.cp
        ip = uses_inner_product(self.config.metric)
        nq = q.shape[0]
        ratio = max(1.0, float(params.get("refine_ratio") or 2.0))
        k0 = min(self._size, max(kk, int(math.ceil(kk * ratio))))
        candidates = cp.full((nq, k0), -1, dtype=cp.int64)
        candidate_d = cp.full((nq, k0), _worst(ip), dtype=cp.float32)
        # ivf_pq.pyx: SearchParams(*, n_probes=20, lut_dtype=np.float32, ...); search(search_params, index, queries,
        # k, neighbors=None, distances=None, resources=None) -- no filter argument
        _run(lib.ivf_pq.search, lib.ivf_pq.SearchParams(n_probes=self._n_probes(params)), self.index, q, k0,
             neighbors=candidates, distances=candidate_d)
        # refine reads dataset[candidate] for every slot: replace empty slots by the query's first real candidate
        # (a query with no candidate at all gets row 0 and is blanked below). All k0 candidates are re-ranked, so
        # the copies sit next to their original and finish() drops them before cutting to k.
        valid = (candidates >= 0) & (candidates < self._size)
        first = cp.take_along_axis(candidates, cp.argmax(valid, axis=1)[:, None], axis=1)
        has_any = valid.any(axis=1)
        first = cp.where(has_any[:, None], first, 0)
        candidates = cp.ascontiguousarray(cp.where(valid, candidates, first))
        if k0 > REFINE_MAX_K:  # beyond refine's limit (see REFINE_MAX_K)
            self.wide_reranks += 1
            scores, rows = rerank(cp, self._dataset, q, candidates, ip)
        else:
            rows = cp.full((nq, k0), -1, dtype=cp.int64)
            scores = cp.full((nq, k0), _worst(ip), dtype=cp.float32)
            # refine.pyx: refine(dataset, queries, candidates, k=None, metric="sqeuclidean", indices=None,
            # distances=None, resources=None) -> (distances, indices); all inputs on one side (device here)
            _run(lib.refine, self._dataset, q, candidates, k=k0, metric=cuvs_metric(self.config.metric),
                 indices=rows, distances=scores)
        rows_host = cp.asnumpy(rows)
        rows_host[~cp.asnumpy(has_any)] = -1
        return cp.asnumpy(scores), rows_host


class CuvsBackend:
    """Keeps collections resident in GPU memory as cuVS indexes (the IndexBackend protocol of resident.py).
    Call it from the one GPU worker thread only (see the module docstring)."""

    name = "cuvs"
    kind = "gpu"

    def __init__(self, build_process: bool = False) -> None:
        # Large builds in a child process (build_process.py), so that they never hold the GPU worker thread. The
        # child constructs this class without arguments: it builds in itself.
        self.builder = DetachedBuilder(f"{__name__}:CuvsBackend") if build_process else None

    def build(self, config: IndexConfig, vectors: np.ndarray) -> CuvsIndex:
        return CuvsIndex.build(config, vectors)

    def load(self, config: IndexConfig, data: bytes) -> CuvsIndex:
        return CuvsIndex.from_bytes(config, data)
