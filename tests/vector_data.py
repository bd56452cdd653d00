"""Seeded vector data and a numpy oracle for the vector tests."""

from __future__ import annotations

import base64

import numpy as np


def clustered(n: int, dim: int, seed: int = 0, clusters: int = 20, noise: float = 0.6) -> np.ndarray:
    """A Gaussian mixture: structured enough for ANN indexes, overlapping enough not to be trivial."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, dim)).astype(np.float32)
    return (centers[rng.integers(0, clusters, n)] + noise * rng.standard_normal((n, dim))).astype(np.float32)


def oracle(data: np.ndarray, queries: np.ndarray, k: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Exact neighbours in float64, in the response convention (smaller is closer): row ids and distances."""
    d, q = data.astype(np.float64), queries.astype(np.float64)
    if metric == "l2":
        dist = np.sqrt(np.maximum(((q[:, None, :] - d[None, :, :]) ** 2).sum(-1), 0))
    elif metric == "cosine":
        dn = d / np.linalg.norm(d, axis=1, keepdims=True)
        qn = q / np.linalg.norm(q, axis=1, keepdims=True)
        dist = 1 - qn @ dn.T
    else:
        dist = -(q @ d.T)
    order = np.argsort(dist, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(dist, order, axis=1)


def b64(vectors: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(vectors, dtype="<f4").tobytes()).decode()


def recall(found: list[list[int]], truth: np.ndarray) -> float:
    k = truth.shape[1]
    return float(np.mean([len(set(f) & set(t.tolist())) / k for f, t in zip(found, truth)]))


def search_concurrently(client, name: str, queries: np.ndarray, k: int, seq: int, threads: int) -> list[list[int]]:
    """Each query as its own single-vector search of collection `name` (session consistency at `seq`), from
    `threads` clients at once; the ids found, in query order."""
    from concurrent.futures import ThreadPoolExecutor

    def search(query: np.ndarray) -> list[int]:
        r = client.post(f"/v1/collections/{name}/search", json={"vector": query.tolist(), "k": k,
                                                                "consistency": "session", "seq": seq})
        assert r.status_code == 200, r.text
        return r.json()["ids"]

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(search, queries))
