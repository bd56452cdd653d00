"""The cuVS adapter (indexes/cuvs_index.py) against an exact NumPy oracle.

The GPU tests skip on a machine without a CUDA device or without cuVS; the tests at the top need neither.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from indexes import filters
from indexes.ann import IndexConfig, check_params
from indexes.distance import exact_search, prepare

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ["cupy", "cuvs", "pylibraft", "rmm"]


# -- runs anywhere ---------------------------------------------------------------------------------------
def test_import_loads_no_gpu_library():
    """Importing the adapter (and reading VERSION) must not import cupy or cuVS: they load on first use."""
    code = f"""
import json, sys
import indexes.cuvs_index as m
assert m.VERSION is None or isinstance(m.VERSION, str)
assert m.CuvsBackend.name == "cuvs" and m.CuvsBackend.kind == "gpu"
print(json.dumps([name for name in {HEAVY!r} if name in sys.modules]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_keep_bitset_layout_matches_cuvs_decoding():
    """1 = keep, LSB-first uint32 words: decoded exactly as cuVS's own tests/ann_utils.py decodes a bitset."""
    from indexes.cuvs_index import keep_bitset

    mask = np.random.default_rng(3).random(75) < 0.4
    bits = keep_bitset(mask, len(mask))
    assert bits.dtype == np.uint32 and len(bits) == 3  # ceil(75 / 32)
    decoded = np.flip(np.unpackbits(bits.view(np.uint8)).reshape(-1, 4, 8), axis=2).reshape(-1)[: len(mask)]
    assert np.array_equal(decoded.astype(bool), mask)
    assert keep_bitset(np.ones(64, dtype=bool), 64).tolist() == [0xFFFFFFFF, 0xFFFFFFFF]


from indexes.cuvs_index import keep_bitset as _KEEP_BITSET  # noqa: E402  (imports no GPU library)


class _NumpyAsCupy:
    """numpy under cupy's names: the adapter's device code is array-namespace code."""

    def __getattr__(self, name):
        return getattr(np, name)

    asnumpy = staticmethod(np.asarray)


def _fake_cuvs_ivf_pq(data: np.ndarray, metric: str, refine_calls: list[int]):
    """A stand-in for cupy + cuVS's IVF-PQ, with cuVS's limit: refine fails for k > 256 (raft's warp sort).
    Its "PQ" search returns the exact top candidates, so exact answers are expected after re-ranking."""
    from types import SimpleNamespace

    def pq_search(params, index, q, k, neighbors, distances, resources):
        s, r = exact_search(np, data, q, k, metric)
        neighbors[:], distances[:] = r, s

    def refine(dataset, q, candidates, k, metric, indices, distances, resources):
        if k > 256:
            raise RuntimeError("RAFT failure: k <= 256 (warpsort capacity)")  # what cuVS raises
        refine_calls.append(k)
        for i in range(len(q)):
            s, r = exact_search(np, dataset[candidates[i]], q[i: i + 1], k, metric)
            indices[i], distances[i] = candidates[i][r[0]], s[0]

    def bf_search(index, q, k, neighbors, distances, resources, prefilter=None):
        keep = None
        if prefilter is not None:  # decoded as cuVS's tests/ann_utils.py decodes a keep-bitset
            keep = np.unpackbits(prefilter.view(np.uint8), bitorder="little")[: len(data)].astype(bool)
        s, r = exact_search(np, data, q, k, metric, keep)
        neighbors[:], distances[:] = r, s

    ivf_pq = SimpleNamespace(SearchParams=lambda **kw: kw, search=pq_search)
    return SimpleNamespace(cp=_NumpyAsCupy(), resources=SimpleNamespace(sync=lambda: None), ivf_pq=ivf_pq,
                           refine=refine, brute_force=SimpleNamespace(search=bf_search),
                           filters=SimpleNamespace(from_bitset=lambda bits: bits))


@pytest.mark.parametrize("metric", ["l2", "inner_product"])
@pytest.mark.parametrize("k, refined", [(100, True), (129, False), (300, False)])
def test_ivf_pq_re_ranks_any_number_of_candidates(monkeypatch, metric, k, refined):
    """refine_ratio 2 over-fetches 2k candidates: cuVS's refine takes k <= 256, so k >= 129 re-ranks another way
    (before, every such search raised and `auto` fell back to pgvector)."""
    from indexes import cuvs_index

    rng = np.random.default_rng(5)
    data = prepare(np, rng.normal(size=(2000, 16)).astype(np.float32), metric)
    queries = prepare(np, rng.normal(size=(7, 16)).astype(np.float32), metric)
    calls: list[int] = []
    monkeypatch.setattr(cuvs_index, "_lib", lambda: _fake_cuvs_ivf_pq(data, metric, calls))
    config = IndexConfig("ivf_pq", metric, 16, check_params("build", "ivf_pq", None, "index_params"))
    index = cuvs_index.CuvsIndex(config, "ivf_pq", None, len(data), dataset=data, n_lists=8)
    scores, rows = index.search(queries, k, {"refine_ratio": 2.0}, None)
    want_scores, want_rows = exact_search(np, data, queries, k, metric)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-3)
    assert bool(calls) == refined and index.wide_reranks == (0 if refined else 1)


@pytest.mark.parametrize("kind", ["brute_force", "ivf_pq"])
def test_deleted_rows_live_in_a_resident_bitset_updated_per_write(monkeypatch, kind):
    """After deletes a search uploads no bitset: the device bitset is updated word by word per delete (before,
    every search packed and uploaded one over all rows), and dead rows are never returned."""
    from indexes import cuvs_index

    rng = np.random.default_rng(8)
    data = rng.normal(size=(1000, 8)).astype(np.float32)
    queries = data[rng.choice(1000, 12, replace=False)] + 0.01
    monkeypatch.setattr(cuvs_index, "_lib", lambda: _fake_cuvs_ivf_pq(data, "l2", []))
    config = IndexConfig(kind, "l2", 8, check_params("build", kind, None, "index_params"))
    index = cuvs_index.CuvsIndex(config, kind, None, len(data), dataset=data, n_lists=8)
    alive = np.ones(len(data), dtype=bool)
    _, nearest = exact_search(np, data, queries, 10, "l2")
    for dead in (nearest[:, 0], nearest[:, 1:4].ravel(), rng.choice(1000, 300, replace=False)):
        index.mark_dead(dead)
        alive[dead] = False
        np.testing.assert_array_equal(index._alive_words, cuvs_index.keep_bitset(alive, len(data)))
        np.testing.assert_array_equal(index._alive_bits, index._alive_words)  # the "device" copy
        packed = []
        monkeypatch.setattr(cuvs_index, "keep_bitset",
                            lambda *a, packed=packed: packed.append(a) or cuvs_index.keep_bitset(*a))
        scores, rows = index.search(queries, 10, {"refine_ratio": 2.0}, None)
        assert packed == []  # nothing packed or uploaded for the search
        monkeypatch.setattr(cuvs_index, "keep_bitset", _KEEP_BITSET)
        want_s, want_rows = exact_search(np, data, queries, 10, "l2", alive)
        np.testing.assert_array_equal(rows, want_rows)
    assert index.n_dead == int((~alive).sum())


def test_rerank_scores_equal_exact_scores_in_small_steps():
    from indexes.cuvs_index import rerank

    rng = np.random.default_rng(6)
    data = rng.normal(size=(500, 8)).astype(np.float32)
    q = rng.normal(size=(9, 8)).astype(np.float32)
    candidates = rng.integers(-1, 500, size=(9, 40))
    for ip in (False, True):
        scores, rows = rerank(np, data, q, candidates, ip, chunk_bytes=1)  # one query per step
        full = (q @ data.T) if ip else ((q[:, None, :] - data[None]) ** 2).sum(-1)
        want = np.take_along_axis(full, np.maximum(candidates, 0), axis=1)
        worst = -np.inf if ip else np.inf
        np.testing.assert_allclose(scores, np.where(candidates >= 0, want, worst), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(rows, candidates)


# -- GPU -------------------------------------------------------------------------------------------------
def _gpu_skip_reason() -> str | None:
    from service.process.devices import probe_cuda

    reasons = []
    probe = probe_cuda()
    if not probe.present:
        reason = probe.reason or "no CUDA device"
        reasons.append(reason if reason.startswith("no CUDA device") else f"no CUDA device ({reason})")
    if importlib.util.find_spec("cuvs") is None:
        reasons.append("cuVS not installed")
    return "; ".join(reasons) or None


@pytest.fixture(scope="module")
def cuvs_index():
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("cuvs", reason="cuVS not installed")
    pytest.importorskip("cupy", reason="cupy not installed")
    from indexes import cuvs_index

    return cuvs_index


N, DIM, NQ, K = 20_000, 32, 200, 10
ANN_TYPES = ["ivf_flat", "ivf_pq", "cagra", "hnsw"]
ALL_TYPES = ["brute_force", *ANN_TYPES]
# Generous search settings: these tests check the adapter, not tuning.
SEARCH = {"brute_force": {}, "ivf_flat": {"n_probes": 32}, "ivf_pq": {"n_probes": 32, "refine_ratio": 4.0},
          "cagra": {"itopk_size": 128, "search_width": 2}, "hnsw": {"ef": 128}}


@pytest.fixture(scope="module")
def data():
    """Seeded clustered data: 64 Gaussian blobs, queries near data points."""
    rng = np.random.default_rng(1234)
    centers = rng.normal(scale=4.0, size=(64, DIM))
    xb = centers[rng.integers(0, 64, size=N)] + rng.normal(size=(N, DIM))
    xq = xb[rng.choice(N, size=NQ, replace=False)] + rng.normal(scale=0.3, size=(NQ, DIM))
    return xb.astype(np.float32), xq.astype(np.float32)


def _config(index_type: str, metric: str) -> IndexConfig:
    return IndexConfig(index_type, metric, DIM, check_params("build", index_type, None, "index_params"))


def _prepared(data, metric):
    xb, xq = data
    return prepare(np, xb, metric), prepare(np, xq, metric)


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    return sum(len(np.intersect1d(f[f >= 0], t[t >= 0])) for f, t in zip(found, truth)) / truth.size


@pytest.mark.parametrize("metric", ["l2", "cosine", "inner_product"])
def test_brute_force_is_exact(cuvs_index, data, metric):
    xb, xq = _prepared(data, metric)
    index = cuvs_index.CuvsIndex.build(_config("brute_force", metric), xb)
    assert (index.supports_add, index.supports_filter, index.size) == (False, True, N)
    scores, rows = index.search(xq, K, {}, None)
    want_scores, want_rows = exact_search(np, xb, xq, K, metric)
    assert scores.dtype == np.float32 and rows.dtype == np.int64 and rows.shape == (NQ, K)
    _assert_exact(scores, rows, want_scores, want_rows)

    keep = np.random.default_rng(5).random(N) < 0.1
    scores, rows = index.search(xq, K, {}, keep)
    want_scores, want_rows = exact_search(np, xb, xq, K, metric, keep)
    _assert_exact(scores, rows, want_scores, want_rows)


def _assert_exact(scores, rows, want_scores, want_rows):
    """Same rows as the oracle, except that neighbours whose scores differ only by float rounding may swap."""
    np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-3)
    differ = rows != want_rows
    assert differ.mean() < 0.01
    for q in np.flatnonzero(differ.any(axis=1)):
        assert set(rows[q][differ[q]]) <= set(want_rows[q]) or np.allclose(
            np.sort(scores[q][differ[q]]), np.sort(want_scores[q][differ[q]]), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("metric", ["l2", "cosine"])  # cosine runs cuVS's inner_product over unit vectors
@pytest.mark.parametrize("index_type", ANN_TYPES)
def test_ann_recall_against_exact(cuvs_index, data, index_type, metric):
    xb, xq = _prepared(data, metric)
    index = cuvs_index.CuvsIndex.build(_config(index_type, metric), xb)
    assert index.size == N and index.engine == "cuvs"
    scores, rows = index.search(xq, K, SEARCH[index_type], None)
    _, want_rows = exact_search(np, xb, xq, K, metric)
    assert rows.shape == (NQ, K) and scores.shape == (NQ, K)
    assert _recall(rows, want_rows) >= 0.9
    # Scores are engine-space (squared L2 or dot product) for the rows returned, best first.
    valid = rows >= 0
    q64, found = xq.astype(np.float64), xb[np.maximum(rows, 0)].astype(np.float64)
    direct = (np.einsum("qd,qkd->qk", q64, found) if metric != "l2"
              else ((found - q64[:, None, :]) ** 2).sum(axis=2))
    np.testing.assert_allclose(scores[valid], direct[valid], rtol=1e-3, atol=1e-2)
    step = np.diff(scores, axis=1)[valid[:, 1:]]
    assert (step <= 1e-5).all() if metric != "l2" else (step >= -1e-5).all()


@pytest.mark.parametrize("index_type", ALL_TYPES)
def test_keep_filter_never_returns_excluded_rows(cuvs_index, data, index_type):
    xb, xq = _prepared(data, "l2")
    index = cuvs_index.CuvsIndex.build(_config(index_type, "l2"), xb)
    assert index.supports_filter == (index_type != "ivf_pq")
    for density in (0.5, 0.02):
        keep = np.random.default_rng(7).random(N) < density
        _, rows = index.search(xq, K, SEARCH[index_type], keep)
        assert rows.shape == (NQ, K)
        assert keep[rows[rows >= 0]].all()
        if index.supports_filter and density == 0.5:
            _, want_rows = exact_search(np, xb, xq, K, "l2", keep)
            assert _recall(rows, want_rows) >= 0.8
    _, rows = index.search(xq, K, SEARCH[index_type], np.zeros(N, dtype=bool))
    assert (rows == -1).all()


@pytest.mark.parametrize("index_type", ALL_TYPES)
def test_round_trip_answers_the_same(cuvs_index, data, index_type):
    xb, xq = _prepared(data, "cosine")
    config = _config(index_type, "cosine")
    index = cuvs_index.CuvsIndex.build(config, xb)
    before = index.search(xq, K, SEARCH[index_type], None)
    blob = index.to_bytes()
    assert isinstance(blob, bytes)
    loaded = cuvs_index.CuvsBackend().load(config, blob)
    assert (loaded.size, loaded.supports_add, loaded.supports_filter) == (
        index.size, index.supports_add, index.supports_filter)
    after = loaded.search(xq, K, SEARCH[index_type], None)
    assert _recall(after[1], before[1]) >= 0.99  # same answers (ties may swap at the k-th place)
    np.testing.assert_allclose(np.sort(after[0], axis=1), np.sort(before[0], axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_type", ALL_TYPES)
def test_added_rows_are_found(cuvs_index, data, index_type):
    xb, _ = _prepared(data, "l2")
    first, rest = xb[:15_000], xb[15_000:]
    config = _config(index_type, "l2")
    index = cuvs_index.CuvsIndex.build(config, first)
    if index_type == "brute_force":
        assert not index.supports_add  # appended rows stay in resident.py's exact delta
        return
    assert index.supports_add
    index.add(rest[:3_000])
    index.add(rest[3_000:])
    assert index.size == N
    probe = np.arange(15_000, N, 50)
    _, rows = index.search(xb[probe], K, SEARCH[index_type], None)
    assert np.mean([p in r for p, r in zip(probe, rows)]) >= 0.9
    # ... and they survive a round trip, after which the index still grows.
    loaded = cuvs_index.CuvsIndex.from_bytes(config, index.to_bytes())
    assert loaded.size == N
    loaded.add(xb[:10])
    assert loaded.size == N + 10
    _, rows = loaded.search(xb[:10], 1, SEARCH[index_type], None)
    assert np.isin(rows[:, 0], np.concatenate([np.arange(10), np.arange(N, N + 10)])).mean() >= 0.9


@pytest.mark.parametrize("index_type", ["cagra", "ivf_pq"])
def test_an_index_built_in_a_build_process_answers_as_one_built_here(cuvs_index, data, index_type, tmp_path):
    """indexes/build_process.py: the child (its own CUDA context) builds, this process loads the bytes."""
    from indexes.build_process import DetachedBuilder

    xb, xq = _prepared(data, "l2")
    config = _config(index_type, "l2")
    backend = cuvs_index.CuvsBackend(build_process=True)
    assert backend.builder is not None and backend.builder.wants(1_000_000, 128)
    loaded = backend.load(config, DetachedBuilder(backend.builder.factory, min_values=0).build(config, xb, tmp_path))
    here = cuvs_index.CuvsIndex.build(config, xb)
    assert (loaded.kind, loaded.size) == (here.kind, here.size)
    _, truth = exact_search(np, xb, xq, K, "l2")
    found, want = loaded.search(xq, K, SEARCH[index_type], None)[1], here.search(xq, K, SEARCH[index_type], None)[1]
    assert _recall(found, truth) >= _recall(want, truth) - 0.05


def test_hnsw_is_cagra_with_double_degree(cuvs_index, data):
    xb, _ = _prepared(data, "l2")
    config = IndexConfig("hnsw", "l2", DIM, check_params("build", "hnsw", {"m": 16}, "index_params"))
    index = cuvs_index.CuvsIndex.build(config, xb)
    assert index.kind == "cagra" and index.index.graph_degree == 32


def test_k_beyond_size_pads_with_missing(cuvs_index, data):
    xb, xq = _prepared(data, "l2")
    index = cuvs_index.CuvsIndex.build(_config("brute_force", "l2"), xb[:5])
    scores, rows = index.search(xq[:3], 8, {}, None)
    assert rows.shape == (3, 8) and (rows[:, :5] >= 0).all() and (rows[:, 5:] == -1).all()
    assert np.isinf(scores[:, 5:]).all()


def test_resident_collection_on_cuvs(cuvs_index, data):
    """The whole path resident.py drives: build, upsert (index add or exact delta), delete, filter, search."""
    from indexes.resident import ResidentCollection

    xb, _ = data
    ids = np.arange(100_000, 100_000 + N, dtype=np.int64)
    for index_type in ("brute_force", "ivf_flat", "cagra"):
        r = ResidentCollection("c", DIM, "l2", index_type, {}, cuvs_index.CuvsBackend())
        r.upsert(ids[:15_000], xb[:15_000], seq=1, payloads=[{"odd": i % 2} for i in range(15_000)])
        r.rebuild()
        r.upsert(ids[15_000:], xb[15_000:], seq=2, payloads=[{"odd": i % 2} for i in range(15_000, N)])
        r.delete(ids[:100], seq=3)
        hits = r.search(xb[[50, 16_000]], 5, SEARCH[index_type])
        assert ids[50] not in hits.ids[0] and hits.ids[1][0] == ids[16_000]
        allowed = ids[100::2]  # even rows, less the deleted ones
        hits = r.search(xb[[16_000, 16_001]], 5, SEARCH[index_type], where=filters.parse({"odd": 0}))
        assert set(sum(hits.ids, [])) <= set(allowed.tolist()) and hits.ids[0][0] == ids[16_000]
