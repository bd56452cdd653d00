"""The ANN index protocol every resident engine implements, and the index types with their parameters.

An index holds rows 0..size-1 of a collection's prepared vectors (unit vectors for cosine) and answers with
row numbers and engine-space scores (squared L2, or dot product for cosine / inner product). Id mapping,
deletes, the exact delta and distance conversion live in indexes/resident.py, shared by every engine.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .errors import InvalidInput

INDEX_TYPES = ("auto", "brute_force", "ivf_flat", "ivf_pq", "cagra", "hnsw")
EXACT_BELOW = 20_000  # `auto` keeps collections smaller than this exact: brute force is fast enough there

# Build parameters per index type, with defaults; anything else a client sends is refused by name.
BUILD_DEFAULTS: dict[str, dict[str, Any]] = {
    "brute_force": {},
    "ivf_flat": {"n_lists": None},  # None: about sqrt(n) at build time
    "ivf_pq": {"n_lists": None, "pq_dim": None, "pq_bits": 8},
    "hnsw": {"m": 32, "ef_construction": 40},  # FAISS's efConstruction default; builds twice as fast as 80
    "cagra": {"graph_degree": 64, "intermediate_graph_degree": 128},
}
SEARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "brute_force": {},
    "ivf_flat": {"n_probes": 20},
    "ivf_pq": {"n_probes": 20, "refine_ratio": 2.0},
    "hnsw": {"ef": 64},
    "cagra": {"itopk_size": 64, "search_width": 1},
}
LIMITS: dict[str, tuple[float, float]] = {
    "n_lists": (1, 65536), "pq_dim": (1, 4096), "pq_bits": (4, 8), "m": (4, 128), "ef_construction": (8, 2048),
    "graph_degree": (8, 256), "intermediate_graph_degree": (8, 512), "n_probes": (1, 65536),
    "refine_ratio": (1, 64), "ef": (1, 4096), "itopk_size": (1, 4096), "search_width": (1, 64),
}


def resolve_type(index_type: str, n_rows: int) -> str:
    if index_type != "auto":
        return index_type
    return "brute_force" if n_rows < EXACT_BELOW else "hnsw"


def check_params(kind: str, index_type: str, given: dict[str, Any] | None, field: str) -> dict[str, Any]:
    """Merge `given` over the defaults for `index_type`, refusing unknown names and out-of-range values."""
    table = BUILD_DEFAULTS if kind == "build" else SEARCH_DEFAULTS
    if index_type == "auto":
        allowed: dict[str, Any] = {}
        for t in ("brute_force", "hnsw"):
            allowed.update(table[t])
    else:
        allowed = table[index_type]
    given = given or {}
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise InvalidInput(f"unknown parameter {unknown[0]!r} for {index_type}; known: {sorted(allowed) or 'none'}",
                           field=f"{field}.{unknown[0]}")
    out = dict(allowed)
    for name, value in given.items():
        if value is None:
            continue
        low, high = LIMITS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
            raise InvalidInput(f"must be a number from {low:g} to {high:g}", field=f"{field}.{name}")
        out[name] = value if name == "refine_ratio" else int(value)
    return out


def search_params(index_type: str, given: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """check_params for a search, as sorted (name, value) pairs (hashable: a micro-batching key), remembered per
    parameter set: clients send the same few sets over and over, and checking them again cost microseconds per
    search. Booleans bypass the memory (True == 1 as a key) and are refused by check_params."""
    items = tuple(sorted(given.items())) if given else ()
    if not any(isinstance(value, bool) for _, value in items):
        try:
            return _checked_search(index_type, items)
        except TypeError:  # an unhashable value, which check_params refuses below
            pass
    return _check_search(index_type, items)


def _check_search(index_type: str, items: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(check_params("search", index_type, dict(items), "params").items()))


_checked_search = functools.lru_cache(maxsize=1024)(_check_search)


def default_n_lists(n_rows: int) -> int:
    # cuVS guidance: about sqrt(n); at least 39 training points per list keeps k-means meaningful.
    return max(1, min(int(round(math.sqrt(max(n_rows, 1)))), n_rows // 39 if n_rows >= 39 else 1))


def default_pq_dim(dim: int, pq_bits: int = 8) -> int:
    """The largest divisor of dim that is at most dim/4 (FAISS needs dim % pq_dim == 0) whose codes fill whole
    bytes (cuVS needs pq_dim * pq_bits % 8 == 0); 0 when no divisor does."""
    for m in range(max(1, dim // 4), 0, -1):
        if dim % m == 0 and (m * pq_bits) % 8 == 0:
            return m
    return 0


def check_build_shape(index_type: str, params: dict[str, Any], dim: int, field: str) -> None:
    """Build parameters that depend on the dimension, checked when the collection is created so that every engine
    can build it later: IVF-PQ's pq_dim divides dim (FAISS) and pq_dim * pq_bits is a multiple of 8 (cuVS's
    documented constraint: each vector's code is whole bytes)."""
    if index_type != "ivf_pq":
        return
    bits = int(params.get("pq_bits") or 8)
    pq_dim = params.get("pq_dim")
    if pq_dim is None:
        if not default_pq_dim(dim, bits):
            raise InvalidInput(f"with pq_bits {bits} no pq_dim dividing dim {dim} makes pq_dim * pq_bits a multiple "
                               f"of 8; give pq_dim, or pq_bits 8", field=f"{field}.pq_bits")
        return
    if dim % pq_dim:
        raise InvalidInput(f"must divide the dimension {dim}", field=f"{field}.pq_dim")
    if (pq_dim * bits) % 8:
        raise InvalidInput(f"pq_dim * pq_bits = {pq_dim} * {bits} must be a multiple of 8 (each code is whole bytes)",
                           field=f"{field}.pq_dim")


def min_train_rows(index_type: str, params: dict[str, Any]) -> int:
    """Rows needed before an index of this type can be built; below this the rows stay in the exact delta.
    k-means wants about 39 points per centroid (FAISS warns below that)."""
    if index_type == "ivf_flat":
        return 39 * (params.get("n_lists") or 1)
    if index_type == "ivf_pq":
        return 39 * max(params.get("n_lists") or 1, 2 ** params.get("pq_bits", 8))
    return 1


@dataclass(frozen=True)
class IndexConfig:
    index_type: str  # resolved: never "auto"
    metric: str
    dim: int
    params: dict[str, Any]


class AnnIndex(Protocol):
    """One engine's index over rows 0..size-1."""

    engine: str  # "faiss", "cuvs" or "exact" (exact_index.py)
    config: IndexConfig
    supports_add: bool  # False: appended rows stay in the exact delta until a rebuild
    supports_filter: bool  # False: deleted / filtered rows are removed by over-fetching

    @property
    def size(self) -> int: ...

    def add(self, vectors: np.ndarray) -> None: ...

    def search(self, queries: np.ndarray, k: int, params: dict[str, Any],
               keep: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]: ...

    def to_bytes(self) -> bytes: ...

    # Optional: copy_for_growth() -> a copy of the index that rows may be added to with the result a build over
    # all of them would give, or None (resident.py's rebuild then builds anew).
