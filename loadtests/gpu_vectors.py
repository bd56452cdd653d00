"""The CuPy exact vector engine's device benchmark, for `make gpu-check` (loadtests/gpu_check.py calls `bench`).

In one process on the GPU machine, per data size (fp32, k=10):
- the physical anchor: nothing but `q @ X.T` and `cupy.argpartition` on the device (issue 38's table);
- the engine in-process as the service runs it: a ResidentCollection over ExactArrayBackend(cupy), searched through
  a MicroBatcher on one engine thread, at batch sizes 1, 16, 256 and 2,048 (concurrent single-vector submits);
- FAISS exact (IndexFlat) on the machine's CPU cores, batch 1 and 256;
- pgvector exact (a sequential scan, asyncpg) on a smaller table, with the engine on the same rows;
answers compared: the engine's top-10 against FAISS's and the anchor's (ties apart). No HTTP here: the figures are
the engine's, not a client's.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from indexes.exact_index import host

BATCHES = (1, 16, 256, 2048)
K = 10


def _clock(fn: Callable[[], Any], min_s: float = 0.5, min_calls: int = 3) -> float:
    """Seconds per call: calls repeated for at least min_s (the median of the calls)."""
    fn()  # the first call compiles and allocates: not timed
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - started < min_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _same_sets(a: np.ndarray, b: np.ndarray) -> float:
    """Share of queries whose top-k row sets are equal."""
    return float(np.mean([set(x.tolist()) == set(y.tolist()) for x, y in zip(a, b)]))


def _agree(data: np.ndarray, queries: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """Share of queries whose two top-k lists have the same distances (float64, rtol 1e-5): equal sets, or sets
    that differ only between rows tied in fp32."""
    def dist(q: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return np.sort(((data[rows].astype(np.float64) - q.astype(np.float64)) ** 2).sum(axis=1))

    return float(np.mean([np.allclose(dist(q, x), dist(q, y), rtol=1e-5, atol=1e-6)
                          for q, x, y in zip(queries, a, b)]))


def anchor(cp: Any, data: Any, queries: np.ndarray, min_s: float = 0.5) -> dict[str, Any]:
    """QPS of `q @ X.T` + argpartition at each batch size, and its top-10 rows of the first queries."""
    out: dict[str, Any] = {}
    sq = cp.sum(data * data, axis=1)
    for b in BATCHES:
        q = cp.asarray(queries[:b])

        def run(q: Any = q) -> Any:
            scores = sq[None, :] - 2 * (q @ data.T)
            return host(cp.argpartition(scores, K, axis=1)[:, :K])

        out[f"batch_{b}_qps"] = round(b / _clock(run, min_s), 1)
    return out


def engine_qps(collection: Any, queries: np.ndarray, batch: int, min_s: float = 1.0) -> dict[str, float]:
    """Single-vector searches through a MicroBatcher on one engine thread, as the manager runs them: one client
    in turn for batch 1, else 2 x batch concurrent clients (each submits its next query as its answer comes), so a
    batch of up to `batch` gathers while the previous one runs. QPS and the mean batch that formed."""
    from indexes.batching import MicroBatcher

    def run(key: int, vectors: np.ndarray) -> list[Any]:
        result = collection.search(vectors, key, {})
        return list(zip(result.ids, result.distances))

    async def measure() -> dict[str, float]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            batcher = MicroBatcher(run, pool, max_batch=batch)
            await batcher.submit(K, queries[0])  # allocates the first buffers
            batches_before, queries_before = batcher.batches, batcher.queries
            end = time.perf_counter() + min_s

            async def client(i: int) -> int:
                n = 0
                while n == 0 or time.perf_counter() < end:  # at least one each: starting them all takes time
                    await batcher.submit(K, queries[(i * 7919 + n) % len(queries)])
                    n += 1
                return n

            started = time.perf_counter()
            done = sum(await asyncio.gather(*(client(i) for i in range(1 if batch == 1 else 2 * batch))))
            elapsed = time.perf_counter() - started
            batches = max(1, batcher.batches - batches_before)
            mean_batch = (batcher.queries - queries_before) / batches
            return {"qps": round(done / elapsed, 1), "mean_batch": round(mean_batch, 1)}

    return asyncio.run(measure())


def faiss_exact(data: np.ndarray, queries: np.ndarray, min_s: float = 0.5) -> tuple[dict[str, Any], np.ndarray]:
    import faiss

    index = faiss.IndexFlatL2(data.shape[1])
    index.add(data)
    out = {"threads": faiss.omp_get_max_threads()}
    out["batch_1_qps"] = round(1 / _clock(lambda: index.search(queries[:1], K), min_s), 1)
    out["batch_256_qps"] = round(256 / _clock(lambda: index.search(queries[:256], K), min_s, min_calls=2), 1)
    _, rows = index.search(queries[:64], K)
    return out, rows


def resident(cp: Any, data: np.ndarray) -> tuple[Any, float]:
    """A collection on the CuPy engine, filled through the change log's path (apply) and built."""
    from indexes.exact_index import ExactArrayBackend
    from indexes.resident import Changes, ResidentCollection

    started = time.perf_counter()
    c = ResidentCollection("bench", data.shape[1], "l2", "brute_force", {}, ExactArrayBackend(cp))
    c.apply(Changes(0, 1, np.empty(0, np.int64), np.arange(len(data), dtype=np.int64), data))
    c.rebuild()
    return c, time.perf_counter() - started


def pgvector_exact(data: np.ndarray, queries: np.ndarray, engine_rows: np.ndarray,
                   dsn: str | None = None) -> dict[str, Any]:
    """pgvector's exact scan over `data` (no index), one asyncpg connection; answers against the engine's."""
    import asyncpg
    from pgvector.asyncpg import register_vector

    from loadtests.processes import embedded_postgres

    async def run(dsn: str) -> dict[str, Any]:
        conn = await asyncpg.connect(dsn)
        await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        await register_vector(conn)
        dim = data.shape[1]
        await conn.execute(f"CREATE TABLE bench (id bigint PRIMARY KEY, embedding vector({dim}))")
        started = time.perf_counter()
        await conn.copy_records_to_table("bench", records=((i, v) for i, v in enumerate(data)),
                                         columns=["id", "embedding"])
        load_s = time.perf_counter() - started
        await conn.execute("ANALYZE bench")
        stmt = await conn.prepare(f"SELECT id FROM bench ORDER BY embedding <-> $1 LIMIT {K}")
        found, times = [], []  # no index on the table: every query is an exact scan
        for q in queries[:len(engine_rows)]:
            t = time.perf_counter()
            found.append([r[0] for r in await stmt.fetch(q)])
            times.append(time.perf_counter() - t)
        await conn.close()
        found_rows = np.array(found)
        return {"rows": len(data), "dim": dim, "load_s": round(load_s, 2),
                "single_query_ms": round(1000 * statistics.median(times), 2),
                "top10_equal_to_engine": _same_sets(found_rows, engine_rows),
                "top10_distances_agree_with_engine": _agree(data, queries, found_rows, engine_rows)}

    if dsn is not None:
        return asyncio.run(run(dsn))
    with embedded_postgres() as own:
        return asyncio.run(run(own))


def bench(size: dict[str, Any], runs: int, xp: Any = None, dsn: str | None = None, budget_s: float | None = None,
          progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """`xp`: cupy (default); numpy runs the same code on the CPU (tests). `dsn`: a PostgreSQL with pgvector for its
    part (default: an embedded one of its own). `budget_s`: a size is started only while at least a third of it
    is left; `progress` gets the report so far after each size (gpu_check keeps it if the part is cut)."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    if xp is None:
        import cupy as xp
    cp = xp
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"k": K, "client": "in-process (MicroBatcher, one engine thread); no HTTP", "sizes": []}
    out["cut"] = []
    for n, dim in size["vector_sets"]:
        if deadline is not None and deadline - time.monotonic() < budget_s / 3:
            out["cut"].append(f"{n} x {dim}: out of time")
            continue
        data = host(cp.random.default_rng(1).standard_normal((n, dim), dtype=np.float32))
        queries = rng.standard_normal((4096, dim)).astype(np.float32)
        row: dict[str, Any] = {"rows": n, "dim": dim}
        collection, row["load_s"] = resident(cp, data)
        row["engine_device_bytes"] = collection.index.device_bytes
        seconds = size.get("seconds", 1.0)  # per figure
        measured = {b: engine_qps(collection, queries, b, seconds) for b in BATCHES}
        row["engine"] = {f"batch_{b}_qps": m["qps"] for b, m in measured.items()}
        row["engine_mean_batch"] = {f"batch_{b}": m["mean_batch"] for b, m in measured.items()}
        device = collection.index._data[:n]
        row["anchor"] = anchor(cp, device, queries, seconds / 2)
        row["engine_over_anchor"] = {f"batch_{b}": round(row["engine"][f"batch_{b}_qps"] /
                                                         row["anchor"][f"batch_{b}_qps"], 3) for b in BATCHES}
        got = np.array(collection.search(queries[:64], K, {}).ids)
        row["faiss_cpu"], faiss_rows = faiss_exact(data, queries, seconds / 2)
        scores = cp.sum(device * device, axis=1)[None, :] - 2 * (cp.asarray(queries[:64]) @ device.T)
        anchor_rows = host(cp.argpartition(scores, K, axis=1)[:, :K])
        row["top10_equal_to_faiss"] = _same_sets(got, faiss_rows)
        row["top10_equal_to_anchor"] = _same_sets(got, anchor_rows)
        row["top10_distances_agree_with_faiss"] = _agree(data, queries[:64], got, faiss_rows)
        out["sizes"].append(row)
        if progress is not None:
            progress(out)
        del collection, device, scores
        if hasattr(cp, "get_default_memory_pool"):
            cp.get_default_memory_pool().free_all_blocks()
    if size.get("pgvector_rows") and (deadline is None or deadline - time.monotonic() > 20):
        n, dim = size["pgvector_rows"], size["vector_sets"][0][1]
        data = rng.standard_normal((n, dim)).astype(np.float32)
        queries = rng.standard_normal((20, dim)).astype(np.float32)
        collection, _ = resident(cp, data)
        engine_rows = np.array(collection.search(queries, K, {}).ids)
        out["pgvector"] = pgvector_exact(data, queries, engine_rows, dsn)
        out["pgvector"]["engine_single_query_ms"] = round(
            1000 / engine_qps(collection, queries, 1, size.get("seconds", 1.0) / 2)["qps"], 3)
    out["exact"] = all(r["top10_distances_agree_with_faiss"] == 1.0 for r in out["sizes"]) and (
        out.get("pgvector", {}).get("top10_distances_agree_with_engine", 1.0) == 1.0)
    return out


SIZES = {
    "quick": {"vector_sets": [(50_000, 64)], "pgvector_rows": 5_000},
    "full": {"vector_sets": [(1_000_000, 128), (1_000_000, 768)], "pgvector_rows": 100_000},
}
