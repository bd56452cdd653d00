"""The exact array engine (indexes/exact_index.py), the GPU vector engine where only CuPy is installed: one
conformance suite run with `xp` = numpy (here) and CuPy (on a CUDA device; skipped with the reason elsewhere).

Answers are checked against a float64 numpy oracle: the same rows (ties apart) and distances, for every metric,
k up to 1,000, deletes, replacements, payload filters, writes after the build, and through the micro-batcher.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers import gpu_library_missing
from indexes.ann import IndexConfig
from indexes.batching import MicroBatcher
from indexes.exact_index import ExactArrayBackend, ExactArrayIndex, chunk_for, smallest_k
from indexes.filters import parse
from indexes.resident import Changes, ResidentCollection
from vector_data import clustered, oracle

CUPY_MISSING = gpu_library_missing("cupy", "CuPy")


def _xp(name: str):
    if name == "numpy":
        return np
    import cupy

    return cupy


XP = [pytest.param("numpy", id="numpy"),
      pytest.param("cupy", id="cupy", marks=pytest.mark.skipif(CUPY_MISSING is not None,
                                                                reason=f"cupy rows: {CUPY_MISSING}"))]


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def assert_matches_oracle(ids, distances, data, queries, k, metric, allowed=None) -> None:
    """Same distances as the float64 oracle; the same rows except where two candidates tie."""
    rows = np.arange(len(data)) if allowed is None else np.flatnonzero(allowed)
    truth_rows, truth_d = oracle(data[rows], queries, k, metric)
    truth_ids = rows[truth_rows]
    scale = max(1.0, float(np.abs(truth_d).max()))
    for q in range(len(queries)):
        got_d = np.asarray(distances[q])
        assert len(ids[q]) == min(k, len(rows)), (q, len(ids[q]))
        np.testing.assert_allclose(got_d, truth_d[q][:len(got_d)], rtol=1e-4, atol=1e-4 * scale)
        differ = np.asarray(ids[q]) != truth_ids[q][:len(ids[q])]
        assert np.all(np.abs(truth_d[q][:len(got_d)][differ] - got_d[differ]) < 1e-4 * scale), q
        assert allowed is None or all(allowed[i] for i in ids[q])


def collection(xp_name: str, metric: str, n: int, dim: int, index_type: str = "brute_force",
               **index_args) -> tuple[ResidentCollection, np.ndarray]:
    backend = ExactArrayBackend(_xp(xp_name))
    if index_args:
        def build(config, vectors, _backend=backend):
            return ExactArrayIndex(config, _backend.xp, vectors, **index_args)
        backend.build = build  # type: ignore[method-assign]
    data = clustered(n, dim, seed=n)
    c = ResidentCollection("c", dim, metric, index_type, {}, backend)
    c.apply(Changes(0, 1, np.empty(0, np.int64), np.arange(n, dtype=np.int64), data,
                    payloads=[{"group": i % 5} for i in range(n)]))
    c.rebuild()
    return c, data


def test_chunked_top_k_is_exact_on_data_built_to_fool_it():
    """The chunk step keeps exactly the k smallest keys on data built to fool it: duplicate keys across chunk
    borders, a chunk holding all of the top k, +inf (excluded) rows. Where keys tie at the k-th place any of them
    may be kept; each column returned holds the key returned beside it, once."""
    rng = np.random.default_rng(3)
    b, n = 7, 32_768
    keys = rng.integers(0, 50, size=(b, n)).astype(np.float32)  # many ties
    keys[1, 4096:4096 + 64] = -1  # one chunk holds everything best
    keys[2, ::3] = np.inf
    keys[3] = np.inf
    keys[3, [5, 40_00, 30_000]] = [2, 1, 2]
    for k in (1, 10, 64, 100, 1000):
        assert chunk_for(n, k) * k * 4 <= n or k >= 100  # the chunked path really runs for small k
        got_keys, got_cols = smallest_k(np, keys, k, full_sort_rows=1024)
        want_keys = np.sort(keys, axis=1)[:, :k]
        np.testing.assert_array_equal(got_keys, want_keys)
        np.testing.assert_array_equal(np.take_along_axis(keys, got_cols, axis=1), got_keys)
        assert all(len(set(row)) == k for row in got_cols.tolist())


@pytest.mark.parametrize("xp_name", XP)
@pytest.mark.parametrize("metric", ["l2", "cosine", "inner_product"])
@pytest.mark.parametrize("full_sort_rows", [1 << 30, 2048], ids=["full-sort", "chunked"])
def test_exact_answers_match_the_oracle(xp_name, metric, full_sort_rows):
    c, data = collection(xp_name, metric, 20_000, 16, full_sort_rows=full_sort_rows)
    queries = clustered(25, 16, seed=99)
    for k in (1, 10, 257, 1000):
        got = c.search(queries, k, {})
        assert_matches_oracle(got.ids, got.distances, data, queries, k, metric)


@pytest.mark.parametrize("xp_name", XP)
def test_blocks_of_queries_give_the_answer_of_one_block(xp_name):
    c, data = collection(xp_name, "l2", 5_000, 8, score_block_bytes=4 * 5_120 * 3)  # three queries a block
    queries = clustered(10, 8, seed=7)
    got = c.search(queries, 10, {})
    assert c.index.searches == 1 and c.index.score_block_bytes // (4 * 5_120) == 3
    assert_matches_oracle(got.ids, got.distances, data, queries, 10, "l2")


@pytest.mark.parametrize("xp_name", XP)
def test_deletes_replacements_and_writes_after_the_build(xp_name):
    c, data = collection(xp_name, "l2", 3_000, 12)
    alive = np.ones(3_000, dtype=bool)
    gone = np.union1d(np.arange(0, 3_000, 7), [3])
    far = np.full((1, 12), 40.0, dtype=np.float32)
    new = data[3:4] + 0.001
    c.apply(Changes(1, 2, gone, np.array([5000, 8], dtype=np.int64), np.vstack([new, far]),
                    payloads=[{"group": 0}, {"group": 3}]))
    alive[gone] = False
    alive[8] = False  # replaced: its old row is dead
    assert c.index.n_dead == alive.size - alive.sum()  # the index dropped them itself (mark_dead)
    got = c.search(data[[3]], 5, {})
    assert got.ids[0][0] == 5000 and 3 not in got.ids[0]  # a new row: in the delta, or added to the index
    assert c.search(far, 1, {}).ids[0] == [8]
    rows = np.vstack([data, new, far])
    ids = np.concatenate([np.arange(3_000), [5000, 8]])
    keep = np.concatenate([alive, [True, True]])
    queries = clustered(6, 12, seed=5)
    got = c.search(queries, 20, {})
    truth_rows, truth_d = oracle(rows[keep], queries, 20, "l2")
    np.testing.assert_allclose(np.asarray(got.distances), truth_d, rtol=1e-4, atol=1e-4)
    assert all(set(g) <= set(ids[keep].tolist()) for g in got.ids)
    c.rebuild()  # compaction: the dead rows leave the index, the answer stays
    again = c.search(queries, 20, {})
    assert c.index.n_dead == 0 and c.index.size == int(keep.sum())
    np.testing.assert_allclose(np.asarray(again.distances), truth_d, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("xp_name", XP)
def test_payload_filters_are_exact_and_their_mask_is_uploaded_once(xp_name):
    c, data = collection(xp_name, "cosine", 6_000, 8, full_sort_rows=2048)
    queries = clustered(4, 8, seed=11)
    where = parse({"group": {"$in": [1, 3]}})
    allowed = np.isin(np.arange(6_000) % 5, [1, 3])
    for _ in range(3):
        got = c.search(queries, 15, {}, where=where)
        assert_matches_oracle(got.ids, got.distances, data, queries, 15, "cosine", allowed)
    assert got.plan is not None
    cached = c.index._filtered
    assert cached is not None  # the filtered base stays on the device for the next search with the filter
    assert c.search(queries, 15, {}, where=where) and c.index._filtered is cached


@pytest.mark.parametrize("xp_name", XP)
def test_any_configured_index_type_is_served_exactly_and_snapshots_round_trip(xp_name):
    c, data = collection(xp_name, "inner_product", 4_000, 8, index_type="hnsw")
    assert c.index.config.index_type == "hnsw" and not c.needs_rebuild()  # no rebuild loop over the type
    queries = clustered(5, 8, seed=13)
    got = c.search(queries, 10, {"ef": 1})  # parameters are accepted and do not lower recall
    assert_matches_oracle(got.ids, got.distances, data, queries, 10, "inner_product")
    state = c.state()
    other = ResidentCollection("c", 8, "inner_product", "hnsw", {}, ExactArrayBackend(_xp(xp_name)))
    other.restore(state)
    again = other.search(queries, 10, {})
    assert again.ids == got.ids


def test_a_bad_snapshot_is_refused():
    index = ExactArrayIndex(IndexConfig("brute_force", "l2", 4, {}), np, np.ones((3, 4), np.float32))
    data = index.to_bytes()
    with pytest.raises(ValueError):
        ExactArrayIndex.from_bytes(IndexConfig("brute_force", "l2", 5, {}), np, data)
    with pytest.raises(ValueError):
        ExactArrayIndex.from_bytes(IndexConfig("brute_force", "l2", 4, {}), np, b"x" * len(data))


@pytest.mark.parametrize("xp_name", XP)
def test_concurrent_single_searches_through_the_micro_batcher(xp_name):
    """Many single-vector searches at once become few engine calls, each answer its own query's."""
    c, data = collection(xp_name, "l2", 10_000, 16, full_sort_rows=2048)
    queries = clustered(64, 16, seed=17)

    def run(key, batch):
        result = c.search(batch, key, {})
        return list(zip(result.ids, result.distances))

    async def main():
        with ThreadPoolExecutor(max_workers=1) as pool:
            batcher = MicroBatcher(run, pool, max_batch=32)
            return await asyncio.gather(*(batcher.submit(10, q) for q in queries))

    calls_before = c.index.searches
    answers = asyncio.run(main())
    assert c.index.searches - calls_before < len(queries)  # batched
    assert_matches_oracle([a[0] for a in answers], [a[1] for a in answers], data, queries, 10, "l2")


@pytest.mark.parametrize("xp_name", XP)
def test_the_warm_up_runs_every_path(xp_name):
    backend = ExactArrayBackend(_xp(xp_name))
    backend.warm_up(dim=8)  # raises if any path fails


def test_the_backend_is_named_for_its_array_module():
    assert ExactArrayBackend(np).name == "exact-numpy"


def test_the_gpu_checks_vector_benchmark_runs_its_code_on_numpy(database_url):
    """loadtests/gpu_vectors.py with numpy for CuPy, at a tiny size: every figure is there and answers agree."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from loadtests import gpu_vectors

    out = gpu_vectors.bench({"vector_sets": [(20_000, 16)], "pgvector_rows": 2_000, "seconds": 0.1}, runs=1, xp=np,
                             dsn=database_url)
    [row] = out["sizes"]
    assert set(row["engine"]) == {f"batch_{b}_qps" for b in gpu_vectors.BATCHES}
    assert all(v > 0 for v in [*row["engine"].values(), *row["anchor"].values()]), (row["engine"], row["anchor"])
    assert row["top10_distances_agree_with_faiss"] == 1.0 and out["exact"]
    assert out["pgvector"]["top10_distances_agree_with_engine"] == 1.0


def test_the_engine_follows_the_change_log_through_the_manager(database_url, tmp_path):
    """As the service runs it (kind gpu, its own engine thread): writes and deletes reach it through PostgreSQL's
    change log, a filter runs on it, answers name it, and a restart restores its snapshot."""
    from conftest import run

    run(_through_the_manager(database_url, tmp_path / "data"))


async def _through_the_manager(dsn: str, data_dir) -> None:
    from helpers import migrated_pool
    from indexes.manager import CollectionManager
    from indexes.vectors import Points
    from service.admission.control import Admission
    from service.settings import Settings

    pool = await migrated_pool(dsn)
    data = clustered(2_000, 8, seed=21)
    queries = clustered(5, 8, seed=22)
    payloads = [b'{"group": %d}' % (i % 3) for i in range(2_000)]

    def manager() -> CollectionManager:
        m = CollectionManager(pool, data_dir, dsn=dsn, guard=Admission(Settings(database_url=dsn, data_dir=data_dir)))
        m.attach("gpu", ExactArrayBackend(np))
        return m

    async def loaded(m: CollectionManager, name: str) -> None:
        """Until the collection's replica has loaded (a new one loads in the background)."""
        for _ in range(600):
            r = m.resident.get(name)
            if m.ready and r is not None and r.loaded:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{name} never loaded")

    first = manager()
    await first.start()
    try:
        await first.create("e", 8, "l2", "hnsw", None, {"type": "none"})
        await first.upsert("e", Points(np.arange(2_000, dtype=np.int64), data, payloads))
        _, seq = await first.delete("e", np.arange(0, 2_000, 10, dtype=np.int64))
        await loaded(first, "e")
        alive = np.arange(2_000) % 10 != 0
        answer = await first.search("e", queries, 10, "gpu", consistency="session", seq=seq)
        assert answer.engine == "exact-numpy"
        assert_matches_oracle(answer.result.ids, answer.result.distances, data, queries, 10, "l2", alive)
        only = await first.search("e", queries, 10, "gpu", payload_filter={"group": 1}, consistency="session",
                                  seq=seq)
        assert_matches_oracle(only.result.ids, only.result.distances, data, queries, 10, "l2",
                              alive & (np.arange(2_000) % 3 == 1))
        await first.save_snapshots()
    finally:
        await first.stop()
    second = manager()
    await second.start()
    try:
        await loaded(second, "e")
        again = await second.search("e", queries, 10, "gpu", consistency="session", seq=seq)
        assert again.result.ids == answer.result.ids
        [snapshot] = (data_dir / "vectors").glob("collection-*.snapshot")
        assert snapshot.name.endswith(".exact-numpy.snapshot")
        await second.drop("e")
        assert not snapshot.exists()
    finally:
        await second.stop()
        await pool.close()


@pytest.mark.parametrize("xp_name", XP)
def test_a_type_that_would_train_is_indexed_on_the_engine_at_once(xp_name):
    """IVF-PQ needs ~10,000 rows to train elsewhere; here its 500 rows are on the engine, not in the host delta."""
    c, data = collection(xp_name, "l2", 500, 8, index_type="ivf_pq")
    assert c.indexed_rows == 500 and c.delta_rows == 0 and not c.needs_rebuild()
    got = c.search(data[:3], 5, {"n_probes": 1})
    assert [ids[0] for ids in got.ids] == [0, 1, 2]
