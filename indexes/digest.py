"""A content digest of a collection: the same number for a resident index and for PostgreSQL's rows when
they hold the same (id, vector) pairs, whatever their order.

Each row hashes to 64 bits (a multilinear hash of the vector's float32 bit patterns with fixed odd weights,
mixed with the id); the digest is the sum of the live rows' hashes modulo 2**64, so it is kept up to date as
rows come and go (add on insert, subtract on delete) and never needs a full pass. Vectors are hashed as a
resident index stores them (indexes/distance.py `prepare`: unit vectors for cosine), which numpy computes
row by row, the same bits however many rows are prepared together.
"""

from __future__ import annotations

import numpy as np

MASK = (1 << 64) - 1
_CHUNK = 4096  # rows hashed at a time: bounds the uint64 temporary to _CHUNK * dim * 8 bytes
_weights: dict[int, np.ndarray] = {}


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, on uint64 arrays (multiplications wrap modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _weights_for(dim: int) -> np.ndarray:
    w = _weights.get(dim)
    if w is None:
        w = _mix(np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
        _weights[dim] = w
    return w


def row_hashes(ids: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """One uint64 per row of (ids, prepared float32 vectors)."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    words = vectors.view(np.uint32)
    weights = _weights_for(dim)
    acc = np.empty(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, n, _CHUNK):
            part = words[start:start + _CHUNK].astype(np.uint64)
            acc[start:start + _CHUNK] = (part * weights).sum(axis=1, dtype=np.uint64)
        keyed = _mix(np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64) ^ np.uint64(0xD6E8FEB86659FD93))
        return _mix(acc ^ keyed)


def total(hashes: np.ndarray) -> int:
    """Sum of row hashes modulo 2**64."""
    with np.errstate(over="ignore"):
        return int(hashes.sum(dtype=np.uint64)) if len(hashes) else 0


def add(digest: int, delta: int) -> int:
    return (digest + delta) & MASK


def sub(digest: int, delta: int) -> int:
    return (digest - delta) & MASK


def show(digest: int) -> str:
    return f"{digest:016x}"
