"""The RAPIDS parts of `make gpu-check` (loadtests/gpu_check.py): cuVS brute force / IVF-PQ / CAGRA recall@10 and
batch QPS, and cuDF's 13 SSB plans (and the same queries as ad-hoc SQL on the resident tables) against DuckDB.
Each runs only where its library is installed; gpu_check skips it with the reason elsewhere."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

SIZES = {  # normal, --quick
    "vectors": ({"vectors": 200_000, "dim": 128, "queries": 10_000}, {"vectors": 20_000, "dim": 64, "queries": 1_000}),
    "olap": ({"sf": 1.0}, {"sf": 0.1}),
}


def timed(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    """Median seconds of `runs` calls after the first, and the last answer."""
    answer, times = fn(), []
    for _ in range(runs):
        started = time.perf_counter()
        answer = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), answer


def bench_vectors(size: dict[str, int], runs: int) -> dict[str, Any]:
    from indexes.ann import IndexConfig, check_params
    from indexes.cuvs_index import CuvsBackend
    from indexes.distance import exact_search

    rng = np.random.default_rng(0)
    n, dim, nq, k = size["vectors"], size["dim"], size["queries"], 10
    centres = rng.normal(size=(200, dim)).astype(np.float32)
    data = (centres[rng.integers(0, 200, n)] + 0.3 * rng.normal(size=(n, dim))).astype(np.float32)
    queries = (centres[rng.integers(0, 200, nq)] + 0.3 * rng.normal(size=(nq, dim))).astype(np.float32)
    _, truth = exact_search(np, data, queries, k, "l2")
    out: dict[str, Any] = {"vectors": n, "dim": dim, "queries": nq, "k": k, "indexes": {}}
    backend = CuvsBackend()
    for index_type, search in (("brute_force", {}), ("ivf_pq", {"n_probes": 32, "refine_ratio": 2.0}),
                               ("cagra", {"itopk_size": 64})):
        config = IndexConfig(index_type, "l2", dim, check_params("build", index_type, None, "index.params"))
        started = time.perf_counter()
        index = backend.build(config, data)
        build_s = time.perf_counter() - started
        seconds, (_, rows) = timed(lambda: index.search(queries, k, search, None), runs)  # noqa: B023
        recall = float(np.mean([len(set(r) & set(t)) / k for r, t in zip(rows.tolist(), truth.tolist())]))
        out["indexes"][index_type] = {"build_s": round(build_s, 3), "recall_at_10": round(recall, 4),
                                      "batch_qps": round(nq / seconds, 1), "params": search}
    return out


def bench_olap(size: dict[str, float], runs: int) -> dict[str, Any]:
    from olap.cudf_engine import CudfEngine
    from olap.duckdb_engine import DuckDBEngine
    from olap.generate import generate
    from olap.queries import QUERIES, render_sql

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ssb"
        generate(size["sf"], directory)
        gpu, cpu = CudfEngine(), DuckDBEngine()
        out: dict[str, Any] = {"sf": size["sf"], "load_s": gpu.load(directory)["load_s"], "queries": {}}
        cpu.load(directory)
        for query_id in QUERIES:
            gpu_s, got = timed(lambda: gpu.run_query(query_id, None), runs)  # noqa: B023
            cpu_s, want = timed(lambda: cpu.run_query(query_id, None), runs)  # noqa: B023
            # the same query as ad-hoc SQL: olap/frame_sql.py on the resident tables (resident_sql counts it)
            sql = render_sql(query_id, None)
            before = gpu.resident_sql
            sql_s, from_sql = timed(lambda: gpu.run_sql(sql, max_rows=None, timeout_s=None), runs)  # noqa: B023
            out["queries"][query_id] = {"cudf_s": round(gpu_s, 5), "duckdb_s": round(cpu_s, 5),
                                        "speedup": round(cpu_s / gpu_s, 2),
                                        "equal": got.as_tuples() == want.as_tuples(),
                                        "cudf_sql_s": round(sql_s, 5), "sql_resident": gpu.resident_sql > before,
                                        "sql_equal": from_sql.as_tuples() == want.as_tuples()}
    return out
