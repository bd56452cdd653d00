"""One conformance suite for every vector engine: exact engines agree with a numpy oracle, ANN engines reach a
stated recall, every engine honours deletes, replacements and payload filters the same way.

Engines: cpu (FAISS, each index type), pgvector (exact scan and HNSW), gpu (cuVS, or where only CuPy is installed
the exact CuPy engine, which serves every index type exactly; skipped with the reason when this machine has no
CUDA device or neither library).
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import gpu_library_missing, service_client, wait_job
from vector_data import b64, clustered, oracle, recall

DIM, N, NQ, K = 24, 3000, 40, 10
DATA = clustered(N, DIM, seed=1)
QUERIES = clustered(NQ, DIM, seed=2)
RECALL_FLOOR = 0.9  # every ANN engine below, with the search parameters given, on this seeded data


def gpu_engine() -> str:
    """The engine the service puts on the GPU here: cuVS where installed, else CuPy's exact engine."""
    return "cuvs" if gpu_library_missing("cuvs", "cuVS") is None else "cupy"


def gpu_skip_reason() -> str | None:
    cuvs, cupy = gpu_library_missing("cuvs", "cuVS"), gpu_library_missing("cupy", "CuPy")
    return None if not (cuvs and cupy) else cuvs if cuvs == cupy else f"{cuvs}; {cupy}"


ENGINES = [
    # (id, engine, index type, build params, search params, exact?)
    ("cpu-brute_force", "cpu", "brute_force", {}, {}, True),
    ("cpu-hnsw", "cpu", "hnsw", {"m": 16, "ef_construction": 64}, {"ef": 128}, False),
    ("cpu-cagra", "cpu", "cagra", {"graph_degree": 32, "intermediate_graph_degree": 64}, {"itopk_size": 128}, False),
    ("cpu-ivf_flat", "cpu", "ivf_flat", {"n_lists": 16}, {"n_probes": 8}, False),
    ("cpu-ivf_pq", "cpu", "ivf_pq", {"n_lists": 8, "pq_dim": 12, "pq_bits": 4}, {"n_probes": 8, "refine_ratio": 8},
     False),
    ("pgvector-exact", "pgvector", "brute_force", {}, {}, True),
    ("pgvector-hnsw", "pgvector", "brute_force", {}, {"ef_search": 200}, False),
    ("gpu-brute_force", "gpu", "brute_force", {}, {}, True),
    ("gpu-cagra", "gpu", "cagra", {}, {"itopk_size": 128}, False),
    ("gpu-ivf_flat", "gpu", "ivf_flat", {"n_lists": 16}, {"n_probes": 8}, False),
    ("gpu-ivf_pq", "gpu", "ivf_pq", {"n_lists": 8}, {"n_probes": 8, "refine_ratio": 4}, False),
]


@pytest.fixture(scope="module")
def app(server_dsn, tmp_path_factory):
    """One service for the module; collections are made per engine and metric as needed."""
    with service_client(server_dsn, "vectors_conformance", tmp_path_factory.mktemp("conformance")) as client:
        yield client


def collection_for(client, engine_id: str, metric: str) -> str:
    """A loaded collection for this engine and metric (made once, then reused)."""
    key = (engine_id, metric)
    if key in client.made:
        return client.made[key]
    _, engine, index_type, build, _, exact = next(e for e in ENGINES if e[0] == engine_id)
    name = f"{engine_id}-{metric}".replace("_", "-")
    pg_index = {"type": "none"} if engine_id == "pgvector-exact" else {"type": "hnsw", "m": 16, "ef_construction": 64}
    r = client.post("/v1/collections", json={"name": name, "dim": DIM, "metric": metric,
                                             "index": {"type": index_type, "params": build},
                                             "pgvector_index": pg_index})
    assert r.status_code == 201, r.text
    r = client.put(f"/v1/collections/{name}/points", json={"ids": list(range(N)), "vectors_b64": b64(DATA),
                                                           "payloads": [{"group": i % 4} for i in range(N)]})
    assert r.status_code == 200, r.text
    state = wait_job(client, client.post(f"/v1/collections/{name}/build").json()["location"])
    assert state["state"] == "succeeded", state
    if engine == "cpu":  # the index really is built: no answer comes from the exact delta
        index_state = client.get(f"/v1/collections/{name}").json()["index_state"]
        assert index_state["index_type"] == index_type and index_state["delta_rows"] == 0, index_state
    client.made[key] = name
    return name


def search(client, name: str, engine: str, queries: np.ndarray, params: dict, **extra) -> dict:
    r = client.post(f"/v1/collections/{name}/search",
                    json={"vectors_b64": b64(queries), "k": K, "engine": engine, "params": params or None, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def engine_param(engine_id: str):
    engine = next(e for e in ENGINES if e[0] == engine_id)[1]
    marks = []
    if engine == "gpu" and (reason := gpu_skip_reason()):
        marks.append(pytest.mark.skip(reason=f"gpu engine: {reason}"))
    return pytest.param(engine_id, marks=marks, id=engine_id)


EXACT = [engine_param(e[0]) for e in ENGINES if e[5]]
ANN = [engine_param(e[0]) for e in ENGINES if not e[5]]
ALL = [engine_param(e[0]) for e in ENGINES]


@pytest.mark.parametrize("metric", ["l2", "cosine", "inner_product"])
@pytest.mark.parametrize("engine_id", EXACT)
def test_exact_engines_match_the_numpy_oracle(app, engine_id, metric):
    _, engine, *_ , _ = next(e for e in ENGINES if e[0] == engine_id)
    name = collection_for(app, engine_id, metric)
    got = search(app, name, engine, QUERIES, {})
    truth_ids, truth_d = oracle(DATA, QUERIES, K, metric)
    assert got["engine"] == {"cpu": "faiss", "gpu": gpu_engine(), "pgvector": "pgvector"}[engine]
    distances = np.array(got["distances"])
    np.testing.assert_allclose(distances, truth_d, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(truth_d).max())))
    # Ids equal the oracle's, except where two candidates tie on distance.
    for q, (ids, want) in enumerate(zip(got["ids"], truth_ids)):
        for j, (a, b) in enumerate(zip(ids, want.tolist())):
            if a != b:
                assert abs(truth_d[q][j] - distances[q][j]) < 1e-4, (q, j, a, b)
    assert all(np.all(np.diff(row) >= -1e-6) for row in distances)  # closest first


@pytest.mark.parametrize("engine_id", ANN)
def test_ann_engines_reach_the_stated_recall(app, engine_id):
    _, engine, _, _, params, _ = next(e for e in ENGINES if e[0] == engine_id)
    name = collection_for(app, engine_id, "l2")
    got = search(app, name, engine, QUERIES, params)
    truth_ids, _ = oracle(DATA, QUERIES, K, "l2")
    assert recall(got["ids"], truth_ids) >= RECALL_FLOOR
    assert all(np.all(np.diff(row) >= -1e-6) for row in got["distances"])


@pytest.mark.parametrize("engine_id", ALL)
def test_payload_filter_returns_only_matching_points(app, engine_id):
    _, engine, _, _, params, exact = next(e for e in ENGINES if e[0] == engine_id)
    name = collection_for(app, engine_id, "l2")
    got = search(app, name, engine, QUERIES, params, filter={"group": 2})
    allowed = np.arange(N)[np.arange(N) % 4 == 2]
    truth_rows, _ = oracle(DATA[allowed], QUERIES, K, "l2")
    truth_ids = allowed[truth_rows]
    for ids in got["ids"]:
        assert len(ids) == K and all(i % 4 == 2 for i in ids)
    assert recall(got["ids"], truth_ids) >= (1.0 if exact else RECALL_FLOOR)


@pytest.mark.parametrize("engine_id", ALL)
def test_recall_endpoint_agrees_with_the_oracle(app, engine_id):
    _, engine, _, _, params, exact = next(e for e in ENGINES if e[0] == engine_id)
    name = collection_for(app, engine_id, "l2")
    r = app.post(f"/v1/collections/{name}/recall", json={"k": K, "engine": engine, "params": params or None,
                                                          "sample": 50, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["queries"] == 50
    assert body["recall"] == 1.0 if exact else body["recall"] >= RECALL_FLOOR


@pytest.mark.parametrize("engine_id", [p for p in ALL if "pgvector-hnsw" not in p.id])
def test_writes_are_visible_to_every_engine(app, engine_id):
    """Upserts, replacements and deletes after the build are honoured at once (delta and tombstones)."""
    _, engine, index_type, build, params, exact = next(e for e in ENGINES if e[0] == engine_id)
    name = f"writes-{engine_id}".replace("_", "-")
    pg_index = {"type": "none"}
    assert app.post("/v1/collections", json={"name": name, "dim": DIM, "index": {"type": index_type, "params": build},
                                             "pgvector_index": pg_index}).status_code == 201
    base = DATA[:1000]
    assert app.put(f"/v1/collections/{name}/points",
                   json={"ids": list(range(1000)), "vectors_b64": b64(base)}).status_code == 200
    assert app.post(f"/v1/collections/{name}/build").status_code == 202
    far = np.full((1, DIM), 50.0, dtype=np.float32)
    # A new point, a replaced point (id 7 moves far away), and deleted points.
    assert app.put(f"/v1/collections/{name}/points",
                   json={"ids": [5000, 7], "vectors_b64": b64(np.vstack([base[3] + 0.001, far]))}).status_code == 200
    assert app.post(f"/v1/collections/{name}/points/delete", json={"ids": [3, 11]}).json()["deleted"] == 2
    near3 = search(app, name, engine, base[[3]], params)["ids"][0]
    assert near3[0] == 5000 and 3 not in near3
    near11 = search(app, name, engine, base[[11]], params)["ids"][0]
    assert 11 not in near11
    assert search(app, name, engine, base[[7]], params)["ids"][0][0] != 7  # the old vector of 7 is gone
    assert search(app, name, engine, far, params)["ids"][0][0] == 7
    assert app.get(f"/v1/collections/{name}").json()["count"] == 1000 + 1 - 2
