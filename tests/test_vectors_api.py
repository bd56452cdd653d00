"""Vector collections over HTTP: lifecycle, encodings, bad input answered 4xx with nothing changed, routing,
micro-batching, bulk loads as jobs."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import orjson
import pyarrow as pa
import pytest

from helpers import assert_problem, wait_ready
from vector_data import b64, clustered, oracle

DIM = 8
DATA = clustered(500, DIM, seed=5)


@pytest.fixture
def col(client):
    """A collection with 500 points (ids 0..499, payload {"even": bool})."""
    wait_ready(client)
    name = f"c{time.monotonic_ns()}"
    assert client.post("/v1/collections", json={"name": name, "dim": DIM}).status_code == 201
    r = client.put(f"/v1/collections/{name}/points", json={
        "ids": list(range(500)), "vectors": DATA.tolist(), "payloads": [{"even": i % 2 == 0} for i in range(500)]})
    assert r.status_code == 200, r.text
    return name


def nearest(client, name, vector, k=5, **extra):
    r = client.post(f"/v1/collections/{name}/search", json={"vector": np.asarray(vector).tolist(), "k": k, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def nearest_through_refusals(client, name, vector, k=5):
    """nearest, sent again while the service refuses it as overloaded: 24 in-process clients at once are a burst
    the event loop's lag gate may shed part of (503 loop_lag), which a client retries."""
    for _ in range(100):
        r = client.post(f"/v1/collections/{name}/search", json={"vector": np.asarray(vector).tolist(), "k": k})
        if r.status_code != 503:
            break
        assert r.json()["type"].endswith(":overloaded") and r.headers["retry-after"], r.text
        time.sleep(0.02)
    assert r.status_code == 200, r.text
    return r.json()


def state(client, name):
    """What a bad request must not change: the count and a search answer."""
    return client.get(f"/v1/collections/{name}").json()["count"], nearest(client, name, DATA[0])["ids"]


def test_create_list_get_delete(client):
    wait_ready(client)
    r = client.post("/v1/collections", json={"name": "life", "dim": 4, "metric": "cosine",
                                             "index": {"type": "hnsw", "params": {"m": 8}}})
    assert r.status_code == 201
    assert r.json()["index"] == {"type": "hnsw", "params": {"m": 8, "ef_construction": 40}}
    assert "life" in [c["name"] for c in client.get("/v1/collections").json()]
    got = client.get("/v1/collections/life").json()
    assert got["count"] == 0 and got["engines"] == ["faiss", "pgvector"] and got["index_state"]["resident"]
    assert_problem(client.post("/v1/collections", json={"name": "life", "dim": 4}), 409, "conflict", "name")
    assert client.delete("/v1/collections/life").status_code == 204
    assert_problem(client.get("/v1/collections/life"), 404, "not-found")
    assert_problem(client.delete("/v1/collections/life"), 404, "not-found")


@pytest.mark.parametrize("body, field", [
    ({"name": "bad name!", "dim": 4}, "name"),
    ({"name": "x", "dim": 0}, "dim"),
    ({"name": "x", "dim": 4, "metric": "manhattan"}, "metric"),
    ({"name": "x", "dim": 4, "index": {"type": "lsh"}}, "index.type"),
    ({"name": "x", "dim": 4, "index": {"type": "hnsw", "params": {"ef_search": 5}}}, "index.params.ef_search"),
    ({"name": "x", "dim": 4, "index": {"type": "hnsw", "params": {"m": 1}}}, "index.params.m"),
    # cuVS encodes each IVF-PQ vector in whole bytes: pq_dim * pq_bits must be a multiple of 8
    ({"name": "x", "dim": 12, "index": {"type": "ivf_pq", "params": {"pq_dim": 3, "pq_bits": 5}}},
     "index.params.pq_dim"),
    ({"name": "x", "dim": 12, "index": {"type": "ivf_pq", "params": {"pq_dim": 5}}}, "index.params.pq_dim"),
    ({"name": "x", "dim": 100, "index": {"type": "ivf_pq", "params": {"pq_bits": 5}}}, "index.params.pq_bits"),
    ({"name": "x", "dim": 4, "pgvector_index": {"type": "hnsw", "m": 1000}}, "pgvector_index.m"),
    ({"name": "x", "dim": 4, "pgvector_index": {"m": 40, "ef_construction": 64}}, "pgvector_index.ef_construction"),
    ({"name": "x", "dim": 2001, "pgvector_index": {"type": "hnsw"}}, "pgvector_index.type"),
    ({"name": "x", "dim": 4, "pgvector_index": {"type": "none", "m": 8}}, "pgvector_index.m"),
])
def test_bad_collection_definitions_name_the_field(client, body, field):
    assert_problem(client.post("/v1/collections", json=body), 422, "validation-error", field)
    assert "x" not in [c["name"] for c in client.get("/v1/collections").json()]


def test_pgvector_index_defaults_follow_the_dimension_and_m(client):
    wide = client.post("/v1/collections", json={"name": "wide", "dim": 2001})
    assert wide.status_code == 201 and wide.json()["pgvector_index"] == {"type": "none"}  # pgvector indexes <= 2,000
    big_m = client.post("/v1/collections", json={"name": "bigm", "dim": 4, "pgvector_index": {"m": 40}})
    assert big_m.json()["pgvector_index"] == {"type": "hnsw", "m": 40, "ef_construction": 80}
    client.put("/v1/collections/wide/points", json={"ids": [1], "vectors": [[0.5] * 2001]})
    job = client.post("/v1/collections/wide/build", params={"pgvector": "wait"}).json()["job"]
    while (state := client.get(f"/v1/jobs/{job}").json())["state"] in ("queued", "running"):
        time.sleep(0.05)
    assert state["state"] == "succeeded", state
    for name in ("wide", "bigm"):
        client.delete(f"/v1/collections/{name}")


def test_vectors_as_json_base64_and_arrow_agree(client, col):
    extra = clustered(30, DIM, seed=9)
    r = client.put(f"/v1/collections/{col}/points",
                   json={"ids": list(range(1000, 1010)), "vectors_b64": b64(extra[:10])})
    assert r.status_code == 200 and r.json()["upserted"] == 10
    table = pa.table({"id": pa.array(range(2000, 2020), pa.int64()),
                      "vector": pa.FixedSizeListArray.from_arrays(pa.array(extra[10:].reshape(-1)), DIM),
                      "payload": pa.array(['{"src": "arrow"}'] * 20)})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    r = client.put(f"/v1/collections/{col}/points", content=sink.getvalue(),
                   headers={"content-type": "application/vnd.apache.arrow.stream"})
    assert r.status_code == 202 and r.headers["location"].startswith("/v1/jobs/")
    for _ in range(200):
        job = client.get(r.headers["location"]).json()
        if job["state"] in ("succeeded", "failed"):
            break
        time.sleep(0.05)
    assert job["state"] == "succeeded" and job["done"] == job["total"] == 20, job
    assert client.get(f"/v1/collections/{col}").json()["count"] == 530
    for i, v in [(1003, extra[3]), (2005, extra[15])]:
        hit = nearest(client, col, v, k=1)
        assert hit["ids"] == [i] and hit["distances"][0] == pytest.approx(0, abs=1e-5)
    assert nearest(client, col, extra[15], k=1, filter={"src": "arrow"})["ids"] == [2005]


def test_distances_follow_one_convention(client):
    wait_ready(client)
    for metric in ("l2", "cosine", "inner_product"):
        name = f"conv-{metric}".replace("_", "-")
        client.post("/v1/collections", json={"name": name, "dim": DIM, "metric": metric})
        client.put(f"/v1/collections/{name}/points", json={"ids": list(range(500)), "vectors": DATA.tolist()})
        q = DATA[7] * 1.5 + 0.1
        ids, want = oracle(DATA, q[None, :], 5, metric)
        for engine in ("cpu", "pgvector"):
            got = nearest(client, name, q, engine=engine)
            assert got["ids"] == ids[0].tolist(), (metric, engine)
            np.testing.assert_allclose(got["distances"], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("body, field", [
    ({"ids": [1], "vectors": [[0.0] * (DIM + 1)]}, "vectors"),
    ({"ids": [1], "vectors": [[float("nan")] + [0.0] * (DIM - 1)]}, "vectors[0]"),
    ({"ids": [1], "vectors": [[float("inf")] + [0.0] * (DIM - 1)]}, "vectors[0]"),
    ({"ids": [1], "vectors_b64": "not base64!"}, "vectors_b64"),
    ({"ids": [1], "vectors_b64": b64(np.zeros(DIM + 1, dtype=np.float32))}, "vectors_b64"),
    ({"ids": [1, 1], "vectors": [[0.0] * DIM] * 2}, "ids"),
    ({"ids": [-1], "vectors": [[0.0] * DIM]}, "ids"),
    ({"ids": [1, 2], "vectors": [[0.0] * DIM]}, "ids"),
    ({"ids": [1], "vectors": [[0.0] * DIM], "payloads": [{"a": 1}, {"b": 2}]}, "payloads"),
    ({"ids": [1]}, None),
    ({"ids": [], "vectors": []}, "ids"),
])
def test_bad_upserts_are_422_and_change_nothing(client, col, body, field):
    before = state(client, col)
    raw = __import__("json").dumps(body)  # NaN and Infinity as JSON tokens, which stdlib JSON accepts
    r = client.put(f"/v1/collections/{col}/points", content=raw, headers={"content-type": "application/json"})
    assert_problem(r, 422, "validation-error", field)
    assert state(client, col) == before


@pytest.mark.parametrize("body, field", [
    ({"vector": [0.0] * (DIM - 1)}, "vector"),
    ({"vector": [float("nan")] * DIM}, "vector[0]"),
    ({"vector": [0.0] * DIM, "k": 0}, "k"),
    ({"vector": [0.0] * DIM, "k": 1001}, "k"),
    ({"vector": [0.0] * DIM, "engine": "quantum"}, "engine"),
    ({"vector": [0.0] * DIM, "params": {"nprobe": 3}}, "params.nprobe"),
    ({"vectors_b64": "@@@"}, "vectors_b64"),
    ({}, None),
    ({"vector": [0.0] * DIM, "vectors": [[0.0] * DIM]}, None),
])
def test_bad_searches_are_422(client, col, body, field):
    raw = __import__("json").dumps(body)
    r = client.post(f"/v1/collections/{col}/search", content=raw, headers={"content-type": "application/json"})
    assert_problem(r, 422, "validation-error", field)


def test_unknown_collection_is_404_everywhere(client):
    wait_ready(client)
    v = [0.0] * DIM
    assert_problem(client.post("/v1/collections/nope/search", json={"vector": v}), 404, "not-found")
    assert_problem(client.put("/v1/collections/nope/points", json={"ids": [1], "vectors": [v]}), 404, "not-found")
    assert_problem(client.post("/v1/collections/nope/points/delete", json={"ids": [1]}), 404, "not-found")
    assert_problem(client.post("/v1/collections/nope/recall", json={}), 404, "not-found")


def test_explicit_gpu_engine_without_a_gpu_is_409_never_substituted(client, col):
    body = assert_problem(client.post(f"/v1/collections/{col}/search",
                                      json={"vector": DATA[0].tolist(), "engine": "gpu"}),
                          409, "engine-unavailable", "engine")
    assert "cpu" in body["detail"]


def test_auto_uses_the_resident_engine_and_pgvector_on_request(client, col):
    assert nearest(client, col, DATA[1])["engine"] == "faiss"
    got = nearest(client, col, DATA[1], engine="pgvector", params={"ef_search": 50})
    assert got["engine"] == "pgvector" and got["ids"][0] == 1 and got["fallback"] is None


def test_concurrent_single_searches_are_micro_batched(client, col):
    batcher = client.app.state.switchyard.vectors.batchers["cpu"]
    before_batches, before_queries = batcher.batches, batcher.queries
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(24)

    def one(i: int) -> None:
        barrier.wait()
        try:
            for j in range(5):
                results[i * 5 + j] = nearest_through_refusals(client, col, DATA[(i * 5 + j) % 500], k=3)["ids"]
        except BaseException as exc:  # noqa: BLE001 - a thread's failure fails the test
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert sorted(results) == list(range(120))
    for n, ids in results.items():
        assert ids[0] == n % 500  # every answer is its own query's
    batched = batcher.queries - before_queries
    calls = batcher.batches - before_batches
    assert batched > 0 and calls < batched, (calls, batched)


def test_engine_metrics_are_recorded(client, col):
    nearest(client, col, DATA[2])
    text = client.get("/metrics").text
    assert 'switchyard_engine_queries_total{domain="vectors",engine="faiss",operation="search",outcome="ok"}' in text


def test_unknown_job_is_404(client):
    assert_problem(client.get("/v1/jobs/00000000-0000-0000-0000-000000000000"), 404, "not-found")
    assert_problem(client.get("/v1/jobs/not-a-uuid"), 404, "not-found")


def raw(matrix) -> bytes:
    return np.ascontiguousarray(matrix, dtype="<f4").tobytes()


def test_raw_float32_searches_answer_as_json_does(client, col):
    queries = clustered(3, DIM, seed=11)
    for q in queries:  # one vector: the same flat answer as {"vector": ...}
        r = client.post(f"/v1/collections/{col}/search?k=4&engine=cpu&consistency=strong", content=raw(q),
                        headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        assert r.json()["ids"] == nearest(client, col, q, k=4, engine="cpu")["ids"]
        assert r.json()["consistency"] == "strong"
    r = client.post(f"/v1/collections/{col}/search?k=3", content=raw(queries),
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["ids"] == oracle(DATA, queries, 3, "l2")[0].tolist()
    r = client.post(f"/v1/collections/{col}/search?k=3&batch=true", content=raw(queries[:1]),
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["ids"] == oracle(DATA, queries[:1], 3, "l2")[0].tolist()


@pytest.mark.parametrize("query, body, field", [
    ("k=3", b"\x00" * (4 * DIM + 2), "body"),          # not whole vectors
    ("k=3", b"", "body"),
    ("k=0", raw(np.zeros(DIM)), "k"),
    ("k=3&ef=lots", raw(np.zeros(DIM)), "ef"),
    ("k=3&engine=tpu", raw(np.zeros(DIM)), "engine"),
    ("k=3", raw(np.full(DIM, np.nan)), "body[0]"),
])
def test_bad_raw_searches_are_422_naming_the_field(client, col, query, body, field):
    before = state(client, col)
    r = client.post(f"/v1/collections/{col}/search?{query}", content=body,
                    headers={"content-type": "application/octet-stream"})
    assert_problem(r, 422, "validation-error", field=field)
    assert state(client, col) == before


@pytest.mark.parametrize("encoding", ["raw", "b64", "json"])
@pytest.mark.parametrize("rows, k, limit", [(10_001, 1, "at most 10,000"), (2_000, 501, "at most 1,000,000")])
def test_search_batches_are_capped_in_every_encoding(client, col, encoding, rows, k, limit):
    queries = np.zeros((rows, DIM), dtype=np.float32)
    if encoding == "raw":
        r = client.post(f"/v1/collections/{col}/search?k={k}&batch=true", content=raw(queries),
                        headers={"content-type": "application/octet-stream"})
        field = "body"
    elif encoding == "b64":
        r = client.post(f"/v1/collections/{col}/search", json={"vectors_b64": b64(queries), "k": k})
        field = "vectors_b64"
    else:
        r = client.post(f"/v1/collections/{col}/search", json={"vectors": queries.tolist(), "k": k})
        field = "vectors"
    if encoding == "json" and rows > 10_000:
        assert_problem(r, 422, "validation-error", field="vectors")  # the schema's own max_length
        return
    body = assert_problem(r, 422, "validation-error", field=field)
    assert limit in body["detail"]
    r = client.post(f"/v1/collections/{col}/search", json={"vectors_b64": b64(queries[:100]), "k": 10})
    assert r.status_code == 200 and len(r.json()["ids"]) == 100  # within the caps


def test_hot_routes_keep_auth_limits_and_metrics(make_client):
    key = "s3cret-key-for-tests"
    client = make_client(api_key=key, max_body_bytes=4096)
    wait_ready(client)
    auth = {"authorization": f"Bearer {key}"}
    assert client.post("/v1/collections", json={"name": "hot", "dim": DIM}, headers=auth).status_code == 201
    body = {"ids": [1, 2], "vectors": DATA[:2].tolist()}
    assert_problem(client.put("/v1/collections/hot/points", json=body), 401, "unauthorized")
    assert client.put("/v1/collections/hot/points", json=body, headers=auth).json()["upserted"] == 2
    assert_problem(client.post("/v1/collections/hot/search", content=raw(DATA[0]),
                               headers={"content-type": "application/octet-stream"}), 401, "unauthorized")
    assert_problem(client.post("/v1/collections/hot/search", content=raw(np.zeros((200, DIM))),
                               headers={**auth, "content-type": "application/octet-stream"}), 413, "payload-too-large")
    for _ in range(3):
        r = client.post("/v1/collections/hot/search?k=1", content=raw(DATA[1]),
                        headers={**auth, "content-type": "application/octet-stream"})
        assert r.json()["ids"] == [2]
    text = client.get("/metrics", headers=auth).text
    assert ('switchyard_http_requests_total{method="POST",route="/v1/collections/{name}/search",status="200"} 3.0'
            in text)
    assert 'switchyard_http_requests_total{method="PUT",route="/v1/collections/{name}/points",status="200"} 1.0' in text
    assert 'route="/v1/collections/{name}/search",status="401"' in text and 'status="413"' in text


def test_searches_and_upserts_the_app_serves_are_counted_once(make_client):
    """A body express does not parse (here text/plain, read as JSON by the route) is served by FastAPI's route
    through the same pipeline, and counted by the app's metrics alone."""
    client = make_client()
    wait_ready(client)
    assert client.post("/v1/collections", json={"name": "once", "dim": DIM}).status_code == 201
    text = {"content-type": "text/plain"}
    body = orjson.dumps({"ids": [1, 2], "vectors": DATA[:2].tolist()})
    assert client.put("/v1/collections/once/points", content=body, headers=text).json()["upserted"] == 2
    search = orjson.dumps({"vector": DATA[1].tolist(), "k": 1, "consistency": "strong"})
    assert client.post("/v1/collections/once/search", content=search, headers=text).json()["ids"] == [2]
    bad = orjson.dumps({"vector": [1.0], "k": 1})
    assert_problem(client.post("/v1/collections/once/search", content=bad, headers=text), 422, "validation-error")
    metrics = client.get("/metrics").text
    for method, route, status in (("PUT", "points", 200), ("POST", "search", 200), ("POST", "search", 422)):
        assert (f'switchyard_http_requests_total{{method="{method}",route="/v1/collections/{{name}}/{route}",'
                f'status="{status}"}} 1.0') in metrics


def test_small_and_large_upserts_store_the_same(client):
    """Up to 1,000 rows an upsert binds arrays, above it COPYs into a staged table: both store every field."""
    wait_ready(client)
    data = clustered(1500, DIM, seed=21)
    for name, sizes in (("small", [700, 700, 100]), ("large", [1500])):
        assert client.post("/v1/collections", json={"name": name, "dim": DIM}).status_code == 201
        start = 0
        for size in sizes:
            ids = list(range(start, start + size))
            r = client.put(f"/v1/collections/{name}/points", json={
                "ids": ids, "vectors_b64": b64(data[start:start + size]),
                "payloads": [{"tag": i % 7} if i % 3 else None for i in ids]})
            assert r.status_code == 200 and r.json()["upserted"] == size, r.text
            start += size
    for i in (0, 1, 2, 700, 1499):
        answers = [nearest(client, name, data[i], k=1, consistency="strong") for name in ("small", "large")]
        assert answers[0]["ids"] == answers[1]["ids"] == [i]
        assert answers[0]["distances"][0] == pytest.approx(0, abs=1e-5)
    for tag in (0, 3):
        got = [nearest(client, name, data[10], k=1000, filter={"tag": tag}, engine="pgvector")["ids"]
               for name in ("small", "large")]
        expected = {i for i in range(1500) if i % 3 and i % 7 == tag}
        assert set(got[0]) == set(got[1]) == expected


def test_small_writes_join_the_index_and_large_ones_wait_in_the_delta(client):
    """Up to 64 rows go straight into the HNSW graph (under the write lock, before the ack); a larger write
    would hold searches and the ack for as long as its adds take, so it waits in the delta, searched exactly."""
    wait_ready(client)
    data = clustered(600, DIM, seed=31)
    assert client.post("/v1/collections", json={"name": "grow", "dim": DIM, "index": {
        "type": "hnsw", "params": {"m": 8, "ef_construction": 32}}}).status_code == 201
    client.put("/v1/collections/grow/points", json={"ids": list(range(300)), "vectors_b64": b64(data[:300])})
    job = client.post("/v1/collections/grow/build").json()
    for _ in range(200):
        if client.get(job["location"]).json()["state"] in ("succeeded", "failed"):
            break
        time.sleep(0.05)

    def rows():
        state = client.get("/v1/collections/grow").json()["index_state"]
        return state["indexed_rows"], state["delta_rows"]

    assert rows() == (300, 0)
    client.put("/v1/collections/grow/points", json={"ids": list(range(300, 340)), "vectors_b64": b64(data[300:340])})
    assert rows() == (340, 0)
    client.put("/v1/collections/grow/points", json={"ids": list(range(340, 600)), "vectors_b64": b64(data[340:600])})
    assert rows() == (340, 260)
    for i in (0, 320, 599):
        assert nearest(client, "grow", data[i], k=1, consistency="strong")["ids"] == [i]


def test_a_load_through_large_upserts_is_built_once_when_it_pauses(client):
    """Large upserts in a row are a load: no background build starts while they keep coming (each would index
    every row again), and one starts once they pause (issue 36: a 50,000 x 768 load spent most of
    its CPU in builds started during it)."""
    from indexes.manager_builds import LOAD_QUIET_S, LOAD_WRITE_ROWS

    wait_ready(client)
    rows = LOAD_WRITE_ROWS + 200
    data = clustered(6 * rows, DIM, seed=41)
    assert client.post("/v1/collections", json={"name": "loaded", "dim": DIM, "index": {
        "type": "hnsw", "params": {"m": 8, "ef_construction": 32}}}).status_code == 201

    def state():
        info = client.get("/v1/collections/loaded").json()
        return info["index_state"]["indexed_rows"], info["replication"]["replicas"][0]["rebuilds"]

    for part in range(6):
        chunk = slice(part * rows, (part + 1) * rows)
        r = client.put("/v1/collections/loaded/points", json={"ids": list(range(chunk.start, chunk.stop)),
                                                              "vectors_b64": b64(data[chunk])})
        assert r.status_code == 200, r.text
        assert state() == (0, 0), f"a build started during the load, after part {part}"
    assert nearest(client, "loaded", data[rows + 7], k=1, consistency="strong")["ids"] == [rows + 7]
    deadline = time.monotonic() + LOAD_QUIET_S + 60
    while state()[0] < 6 * rows - 500 and time.monotonic() < deadline:  # the build holds calibration rows out
        time.sleep(0.2)
    indexed, rebuilds = state()
    assert indexed >= 6 * rows - 500 and rebuilds == 1


def test_a_load_is_as_long_as_its_writes_keep_their_cadence(monkeypatch):
    """The quiet time that ends a load is twice the longest gap between its large writes so far (within bounds):
    writes 1.4 s apart (VectorDBBench's two inserters at 768-d), at times in pairs, are one load, not a load that
    ends after every second or after each pair."""
    from types import SimpleNamespace

    import indexes.manager_builds as builds

    clock = [100.0]
    monkeypatch.setattr(builds.time, "monotonic", lambda: clock[0])
    r = SimpleNamespace(loading_since=0.0, loading_until=0.0, last_load_write=0.0, load_gap=0.0)
    write = lambda at, rows=5000: (clock.__setitem__(0, at), builds.Builds.note_write(None, r, rows))  # noqa: E731
    write(100.0)
    assert (r.loading_since, r.loading_until) == (100.0, 100.0 + builds.LOAD_QUIET_S)
    assert builds.LOAD_QUIET_S > 1.4  # the second write of such a load comes before the first's quiet ends
    write(101.4)
    write(102.8)
    assert r.loading_since == 100.0 and r.loading_until == pytest.approx(102.8 + 2.8)
    write(102.9)  # the other inserter's write, just after: the load's cadence is still 1.4 s
    assert r.loading_until == pytest.approx(102.9 + 2.8)
    write(104.0, rows=builds.LOAD_WRITE_ROWS - 1)  # a small write is not part of a load
    assert r.loading_until == pytest.approx(105.7)
    write(110.0)  # a gap longer than LOAD_MAX_QUIET_S: a new load, whose cadence is not known yet
    assert (r.loading_since, r.loading_until) == (110.0, 110.0 + builds.LOAD_QUIET_S)
    write(110.1)
    assert r.loading_until == pytest.approx(110.1 + builds.LOAD_QUIET_S)
    write(114.9)  # never longer than LOAD_MAX_QUIET_S
    assert r.loading_since == 110.0 and r.loading_until == pytest.approx(114.9 + builds.LOAD_MAX_QUIET_S)


def test_large_json_bodies_are_parsed_off_the_event_loop(client, monkeypatch):
    """A JSON body over LARGE_BODY_BYTES is parsed on a thread (20 MB of payloads held the loop 130 ms): stored
    and answered as any other, a bad one still a 422 naming the field."""
    import asyncio

    import service.pipeline as pipeline

    parsed: list[tuple[int, bool]] = []  # (body bytes, parsed on the event loop)

    def recorder(parse):
        def record(collection, raw, *args):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            parsed.append((len(raw), on_loop))
            return parse(collection, raw, *args)
        return record

    monkeypatch.setattr(pipeline, "parse_upsert", recorder(pipeline.parse_upsert))
    monkeypatch.setattr(pipeline, "parse_search", recorder(pipeline.parse_search))
    wait_ready(client)
    assert client.post("/v1/collections", json={"name": "big_bodies", "dim": DIM}).status_code == 201
    data = clustered(2000, DIM, seed=8)
    body = {"ids": list(range(2000)), "vectors": data.tolist(), "payloads": [{"note": "n" * 200}] * 2000}
    raw = orjson.dumps(body)
    assert len(raw) > pipeline.LARGE_BODY_BYTES
    r = client.put("/v1/collections/big_bodies/points", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["upserted"] == 2000, r.text
    assert nearest(client, "big_bodies", data[1999], k=1, consistency="strong")["ids"] == [1999]
    bad = orjson.dumps({**body, "payloads": body["payloads"][:-1]})
    r = client.put("/v1/collections/big_bodies/points", content=bad, headers={"content-type": "application/json"})
    assert_problem(r, 422, "validation-error", "payloads")
    queries = orjson.dumps({"vectors": np.repeat(data[:10], 400, axis=0).tolist(), "k": 1})
    assert len(queries) > pipeline.LARGE_BODY_BYTES
    r = client.post("/v1/collections/big_bodies/search", content=queries, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["ids"][3999] == [9], r.text[:300]
    large = [on_loop for size, on_loop in parsed if size > pipeline.LARGE_BODY_BYTES]
    assert len(large) >= 3 and not any(large), parsed
    assert any(on_loop for size, on_loop in parsed if size <= pipeline.LARGE_BODY_BYTES)  # small ones stay on it
