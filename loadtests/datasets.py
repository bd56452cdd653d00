"""Load-test data: seeded vectors or the user's .npy files, exact ground truth, saved in the folder that the
Locust files read (queries.npy, neighbors.npy, meta.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRUTH_DEPTH = 100  # neighbours kept per query: recall@k for any k up to this from one file


@dataclass
class VectorData:
    base: np.ndarray       # (n, dim) float32, ids 0..n-1
    queries: np.ndarray    # (q, dim) float32
    metric: str
    source: str


def mixture(n: int, n_queries: int, dim: int, seed: int = 0, latent: int = 32, clusters: int = 1000,
            noise: float = 0.35) -> tuple[np.ndarray, np.ndarray]:
    """A Gaussian mixture in a 32-d latent space projected to `dim` plus isotropic noise (loadtests/bench_vectors.py's
    data): overlapping clusters, so approximate indexes need real effort to reach recall 0.95."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, latent)).astype(np.float32)
    projection = (rng.standard_normal((latent, dim)) / np.sqrt(latent)).astype(np.float32)

    def sample(m: int) -> np.ndarray:
        z = centers[rng.integers(0, clusters, m)] + rng.standard_normal((m, latent)).astype(np.float32)
        return (z @ projection + noise * rng.standard_normal((m, dim)).astype(np.float32)).astype(np.float32)

    return sample(n), sample(n_queries)


def load_vectors(vectors: str | None, queries: str | None, n: int, dim: int, n_queries: int, metric: str,
                 seed: int) -> VectorData:
    """The user's .npy files, or a seeded mixture. Without a queries file, the last `n_queries` rows of the
    user's vectors become the queries and are left out of the collection."""
    if vectors is None:
        base, q = mixture(n, n_queries, dim, seed)
        return VectorData(base, q, metric, f"seeded mixture n={n} dim={dim} seed={seed}")
    base = np.load(vectors, mmap_mode="r")
    if base.ndim != 2:
        raise SystemExit(f"{vectors}: need an (n, dim) array, got shape {base.shape}")
    if queries is not None:
        q = np.load(queries)
        if q.ndim != 2 or q.shape[1] != base.shape[1]:
            raise SystemExit(f"{queries}: need (q, {base.shape[1]}) queries, got shape {q.shape}")
    else:
        if len(base) <= n_queries:
            raise SystemExit(f"{vectors}: {len(base)} rows, not enough to hold out {n_queries} queries")
        base, q = base[:-n_queries], base[-n_queries:]
    return VectorData(np.ascontiguousarray(base, dtype=np.float32), np.ascontiguousarray(q, dtype=np.float32),
                      metric, f"{vectors}" + (f" + {queries}" if queries else f" (last {n_queries} rows as queries)"))


def exact_neighbors(base: np.ndarray, queries: np.ndarray, metric: str, depth: int = TRUTH_DEPTH) -> np.ndarray:
    """Exact nearest ids by brute force (FAISS flat indexes: the same answer as numpy, in BLAS)."""
    import faiss

    depth = min(depth, len(base))
    index: faiss.IndexFlat
    if metric == "l2":
        index = faiss.IndexFlatL2(base.shape[1])
    else:
        index = faiss.IndexFlatIP(base.shape[1])
        if metric == "cosine":
            base, queries = _unit(base), _unit(queries)
    index.add(base)
    return index.search(queries, depth)[1].astype(np.int64)


def _unit(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(norms == 0, 1, norms)).astype(np.float32)


def save(folder: Path, data: VectorData, neighbors: np.ndarray, collection: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "queries.npy", data.queries)
    np.save(folder / "neighbors.npy", neighbors)
    (folder / "meta.json").write_text(json.dumps({
        "collection": collection, "rows": len(data.base), "dim": data.base.shape[1], "queries": len(data.queries),
        "metric": data.metric, "truth_depth": neighbors.shape[1], "source": data.source}, indent=1))
    return folder
