"""Hostile or odd input to the vector API, through a running service: each answered with a 422
application/problem+json naming the field, nothing stored (issue 34, items 2, 11 and 13).

- payload keys: a collection holds at most SWITCHYARD_MAX_PAYLOAD_KEYS distinct top-level keys, counted before
  anything is written, on JSON upserts and Arrow bulk loads alike;
- payloads PostgreSQL or orjson cannot take (an integer beyond 64 bits, a NUL character), filter numbers beyond
  float64, a negative recall seed;
- zero vectors under cosine: refused on every write path (JSON lists, base64, Arrow) and on searches of every
  engine, so no engine answers a distance the others would not.
"""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pyarrow as pa
import pytest

from helpers import assert_problem, wait_job, wait_ready

DIM = 4
ARROW = {"content-type": "application/vnd.apache.arrow.stream"}


def new_collection(client, metric: str = "l2", rows: int = 8) -> str:
    """A collection of `rows` points (ids 0.., payload {"n": i}); its name."""
    wait_ready(client)
    name = f"b{time.monotonic_ns()}"
    assert client.post("/v1/collections", json={"name": name, "dim": DIM, "metric": metric}).status_code == 201
    vectors = np.random.default_rng(1).normal(size=(rows, DIM)).astype(np.float32) + 0.5
    r = client.put(f"/v1/collections/{name}/points", json={
        "ids": list(range(rows)), "vectors": vectors.tolist(), "payloads": [{"n": i} for i in range(rows)]})
    assert r.status_code == 200, r.text
    return name


def count(client, name: str) -> int:
    return client.get(f"/v1/collections/{name}").json()["count"]


def arrow_body(ids, vectors, payloads=None) -> bytes:
    columns = {"id": pa.array(ids, pa.int64()),
               "vector": pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(vectors, np.float32).reshape(-1)), DIM)}
    if payloads is not None:
        columns["payload"] = pa.array(payloads)
    batch = pa.record_batch(columns)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


# -- item 2: distinct payload keys per collection --------------------------------------------------------------
def test_a_point_with_more_keys_than_a_collection_may_hold_is_refused(make_client):
    client = make_client(max_payload_keys=16)
    name = new_collection(client)
    many = {f"k{i}": i for i in range(17)}
    before = count(client, name)
    problem = assert_problem(client.put(f"/v1/collections/{name}/points", json={
        "ids": [100], "vectors": [[1, 2, 3, 4]], "payloads": [many]}), 422, "validation-error", "payloads")
    assert "at most 16" in problem["detail"]
    assert count(client, name) == before
    assert client.post(f"/v1/collections/{name}/search", json={
        "vector": [1, 2, 3, 4], "k": 3, "filter": {"k0": 0}, "engine": "pgvector"}).json()["ids"] == []
    # Up to the limit is fine ("n" is already held: 15 more make 16), and one more key after that is not.
    r = client.put(f"/v1/collections/{name}/points", json={
        "ids": [100], "vectors": [[1, 2, 3, 4]], "payloads": [{f"k{i}": i for i in range(15)}]})
    assert r.status_code == 200, r.text
    assert_problem(client.put(f"/v1/collections/{name}/points", json={
        "ids": [101], "vectors": [[1, 2, 3, 4]], "payloads": [{"another": 1}]}), 422, "validation-error", "payloads")
    assert count(client, name) == before + 1
    # Keys already held are always welcome.
    assert client.put(f"/v1/collections/{name}/points", json={
        "ids": [102], "vectors": [[1, 2, 3, 4]], "payloads": [{"k3": "x", "n": 5}]}).status_code == 200


def test_the_key_limit_holds_for_arrow_bulk_loads_before_anything_is_written(make_client):
    client = make_client(max_payload_keys=8)
    name = new_collection(client)
    vectors = np.ones((3, DIM), np.float32)
    payloads = ['{"a": 1, "b": 2, "c": 3}', '{"d": 1, "e": 2, "f": 3}', '{"g": 1, "h": 2}']  # 8 new + "n" = 9
    r = client.put(f"/v1/collections/{name}/points", content=arrow_body([50, 51, 52], vectors, payloads),
                   headers=ARROW)
    assert_problem(r, 422, "validation-error", "payloads")
    assert count(client, name) == 8
    r = client.put(f"/v1/collections/{name}/points", content=arrow_body([50, 51, 52], vectors,
                                                                        [*payloads[:2], "{}"]), headers=ARROW)
    assert r.status_code == 202, r.text
    assert wait_job(client, r.headers["location"])["state"] == "succeeded"
    assert count(client, name) == 11


def many_keys(n: int, prefix: str = "key") -> dict:
    """A payload of n keys, each long enough that a few thousand of them make a large body (over 256 KiB)."""
    return {f"{prefix}_{j:06d}_{'p' * 40}": j for j in range(n)}


def test_a_large_body_with_too_many_keys_is_refused_by_its_count_before_it_is_built(make_client):
    """A body over 256 KiB is parsed off the event loop; one with more keys than a collection may hold is refused
    from simdjson's count of its keys (the payload named, with the count), not after building it."""
    client = make_client(max_payload_keys=1000)
    name = new_collection(client)
    r = client.put(f"/v1/collections/{name}/points", json={
        "ids": [100, 101], "vectors": [[1, 2, 3, 4]] * 2, "payloads": [{"n": 1}, many_keys(6000)]})
    problem = assert_problem(r, 422, "validation-error", "payloads[1]")
    assert "6,000 top-level keys" in problem["detail"] and "at most 1,000" in problem["detail"]
    # Spread over many points, each under the limit, the distinct keys of the body alone are counted too.
    r = client.put(f"/v1/collections/{name}/points", json={
        "ids": list(range(100, 110)), "vectors": [[1, 2, 3, 4]] * 10,
        "payloads": [many_keys(600, f"p{i}") for i in range(10)]})
    assert_problem(r, 422, "validation-error", "payloads")
    assert count(client, name) == 8


def test_a_large_body_within_a_raised_key_limit_is_stored(make_client):
    """The count uses the engine's configured limit: 6,000 keys in one payload fit a limit of 10,000."""
    client = make_client(max_payload_keys=10_000)
    name = new_collection(client)
    payload = many_keys(6000)
    r = client.put(f"/v1/collections/{name}/points", json={
        "ids": [100], "vectors": [[1, 2, 3, 4]], "payloads": [payload]})
    assert r.status_code == 200, r.text
    last = next(reversed(payload))
    r = client.post(f"/v1/collections/{name}/search", json={
        "vector": [1, 2, 3, 4], "k": 3, "filter": {last: 5999}, "consistency": "strong"})
    assert r.json()["ids"] == [100], r.text


# -- item 11: payloads, filters and seeds that once gave a 500 --------------------------------------------------
@pytest.mark.parametrize("payload", [
    {"big": 2**64},  # beyond 64 bits: orjson cannot write it
    {"big": -(2**63) - 1},
    {"text": "a\u0000b"},  # PostgreSQL's jsonb cannot hold NUL
    {"a\u0000": 1},
    {"nested": [{"deep": "\u0000"}]},
])
def test_payloads_postgresql_cannot_store_are_422_naming_the_payload(client, payload):
    name = new_collection(client)
    r = client.put(f"/v1/collections/{name}/points", json={
        "ids": [1, 100], "vectors": [[1, 2, 3, 4], [4, 3, 2, 1]], "payloads": [None, payload]})
    assert_problem(r, 422, "validation-error", "payloads[1]")
    assert count(client, name) == 8
    # A string that only looks like one (a backslash, then u0000) is stored as it is.
    r = client.put(f"/v1/collections/{name}/points", json={
        "ids": [100], "vectors": [[4, 3, 2, 1]], "payloads": [{"text": "\\u0000", "big": 2**64 - 1}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("payload", ['{"a": 1e309}', '{"a": NaN}', '{"a": -Infinity}', '{"a": [1, {"b": 1e999}]}'])
def test_payload_numbers_that_are_not_finite_are_422_not_stored_as_null(client, payload):
    """JSON has no NaN or Infinity, and 1e309 is past float64: orjson would write each as null, so the point would
    be stored with a value other than the one sent. A null sent as null is kept."""
    name = new_collection(client)
    body = f'{{"ids": [1, 100], "vectors": [[1, 2, 3, 4], [4, 3, 2, 1]], "payloads": [null, {payload}]}}'
    r = client.put(f"/v1/collections/{name}/points", content=body, headers={"content-type": "application/json"})
    assert_problem(r, 422, "validation-error", "payloads[1]")
    r = client.put(f"/v1/collections/{name}/points", headers=ARROW, content=arrow_body(
        [50], np.ones((1, DIM)), [payload.replace("NaN", "1e309").replace("-Infinity", "-1e309")]))
    assert_problem(r, 422, "validation-error", "payloads[0]")
    assert count(client, name) == 8
    r = client.put(f"/v1/collections/{name}/points", json={"ids": [100], "vectors": [[4, 3, 2, 1]],
                                                           "payloads": [{"a": None, "b": [None, 1.5]}]})
    assert r.status_code == 200, r.text


def test_arrow_payloads_with_nul_are_refused_before_the_load(client):
    name = new_collection(client)
    r = client.put(f"/v1/collections/{name}/points", headers=ARROW, content=arrow_body(
        [50, 51], np.ones((2, DIM)), ['{"ok": 1}', '{"bad": "x\\u0000"}']))
    assert_problem(r, 422, "validation-error", "payloads[1]")
    assert count(client, name) == 8


@pytest.mark.parametrize("engine", ["cpu", "pgvector"])
@pytest.mark.parametrize("filter_, field", [
    ({"n": int("9" * 400)}, "filter.n"),
    ({"n": {"$gt": -int("9" * 309)}}, "filter.n.$gt"),
    ({"n": {"$in": [1, int("1" * 500)]}}, "filter.n.$in[1]"),
    ({"n": "a\u0000"}, "filter.n"),
])
def test_filter_values_beyond_what_engines_hold_are_422_naming_the_filter(client, engine, filter_, field):
    name = new_collection(client)
    r = client.post(f"/v1/collections/{name}/search", json={"vector": [1, 2, 3, 4], "filter": filter_,
                                                             "engine": engine})
    assert_problem(r, 422, "validation-error", field)


def test_a_negative_recall_seed_is_422_naming_the_seed(client):
    name = new_collection(client)
    assert_problem(client.post(f"/v1/collections/{name}/recall", json={"seed": -1, "sample": 4}), 422,
                   "validation-error", "seed")
    r = client.post(f"/v1/collections/{name}/recall", json={"seed": 7, "sample": 4, "k": 3})
    assert r.status_code == 200, r.text
    assert r.json()["recall"] == 1.0


# -- item 13: zero vectors under cosine ----------------------------------------------------------------------
def test_zero_vectors_are_refused_on_every_write_path_of_a_cosine_collection(client):
    name = new_collection(client, "cosine")
    zero_row = [[1, 2, 3, 4], [0, 0, 0, 0]]
    assert_problem(client.put(f"/v1/collections/{name}/points", json={"ids": [50, 51], "vectors": zero_row}), 422,
                   "validation-error", "vectors[1]")
    raw = base64.b64encode(np.asarray(zero_row, "<f4").tobytes()).decode()
    assert_problem(client.put(f"/v1/collections/{name}/points", json={"ids": [50, 51], "vectors_b64": raw}), 422,
                   "validation-error", "vectors_b64[1]")
    assert_problem(client.put(f"/v1/collections/{name}/points", content=arrow_body([50, 51], zero_row),
                              headers=ARROW), 422, "validation-error", "vector")
    # -0.0 is zero too
    assert_problem(client.put(f"/v1/collections/{name}/points", json={"ids": [50], "vectors": [[-0.0] * DIM]}),
                   422, "validation-error", "vectors[0]")
    assert count(client, name) == 8


@pytest.mark.parametrize("engine", ["auto", "cpu", "pgvector"])
def test_zero_queries_are_refused_on_every_engine_of_a_cosine_collection(client, engine):
    name = new_collection(client, "cosine")
    assert_problem(client.post(f"/v1/collections/{name}/search", json={"vector": [0, 0, 0, 0], "engine": engine}),
                   422, "validation-error", "vector")
    assert_problem(client.post(f"/v1/collections/{name}/search", json={
        "vectors": [[1, 1, 1, 1], [0, 0, 0, 0]], "engine": engine}), 422, "validation-error", "vectors[1]")
    raw = np.zeros(DIM, "<f4").tobytes()
    assert_problem(client.post(f"/v1/collections/{name}/search?engine={engine}", content=raw,
                               headers={"content-type": "application/octet-stream"}), 422, "validation-error")
    assert_problem(client.post(f"/v1/collections/{name}/recall", json={"queries": [[0, 0, 0, 0]]}), 422,
                   "validation-error", "queries[0]")
    # A non-zero query is answered the same way by both engines.
    query = {"vector": [1, 0.5, 0.25, 2], "k": 8}
    cpu = client.post(f"/v1/collections/{name}/search", json={**query, "engine": "cpu"}).json()
    pg = client.post(f"/v1/collections/{name}/search", json={**query, "engine": "pgvector"}).json()
    assert cpu["ids"] == pg["ids"]
    assert np.allclose(cpu["distances"], pg["distances"], atol=1e-5)


def test_zero_vectors_stay_welcome_under_l2_and_inner_product(client):
    for metric in ("l2", "inner_product"):
        name = new_collection(client, metric)
        assert client.put(f"/v1/collections/{name}/points", json={
            "ids": [50], "vectors": [[0, 0, 0, 0]]}).status_code == 200
        r = client.post(f"/v1/collections/{name}/search", json={"vector": [0, 0, 0, 0], "k": 2})
        assert r.status_code == 200, r.text


def test_collections_stored_before_the_key_registry_have_their_keys_counted(server_dsn):
    """Migration 0008 records the keys of payloads already stored, so the limit counts them too."""
    import asyncpg

    from conftest import fresh_database, run
    from service.database.migrate import apply_migrations, load_migrations

    async def migrate(dsn: str) -> list[str]:
        conn = await asyncpg.connect(dsn)
        try:
            await apply_migrations(conn, [m for m in load_migrations() if m.version < 8])
            cid = await conn.fetchval("INSERT INTO vector_collections (name, dim, metric, index_type) "
                                      "VALUES ('old', 2, 'l2', 'auto') RETURNING id")
            await conn.execute(f"CREATE TABLE vectors_{cid} (id bigint PRIMARY KEY, embedding vector(2) NOT NULL, "
                               "payload jsonb, seq bigint NOT NULL)")
            await conn.execute(f"INSERT INTO vectors_{cid} VALUES (1, '[1,2]', '{{\"a\": 1, \"b\": 2}}', 1), "
                               f"(2, '[1,2]', '{{\"b\": 3, \"c\": 4}}', 2), (3, '[1,2]', NULL, 3), "
                               f"(4, '[1,2]', '[1]', 4)")
            await apply_migrations(conn)
            rows = await conn.fetch("SELECT key FROM vector_payload_keys WHERE collection_id = $1", cid)
            return sorted(r["key"] for r in rows)
        finally:
            await conn.close()

    with fresh_database(server_dsn, "payload_key_backfill") as dsn:
        assert run(migrate(dsn)) == ["a", "b", "c"]


def test_a_stated_dimension_other_than_the_collections_is_422_naming_dim(client):
    """Bytes carry no shape: 3 rows of dimension 2 for 2 ids are 24 bytes, as 2 rows of dimension 3 are. A request
    that states its vectors' dimension (the client always does) is checked against the collection's."""
    name = new_collection(client, rows=2)
    before = client.post(f"/v1/collections/{name}/search", json={"vector": [1.0, 0.0, 0.0, 0.0], "k": 2}).json()
    wrong = np.arange(2 * DIM, dtype="<f4").reshape(DIM, 2)  # DIM rows of dimension 2: the bytes of 2 rows of DIM
    b64 = base64.b64encode(wrong.tobytes()).decode()
    assert_problem(client.put(f"/v1/collections/{name}/points", json={"ids": [0, 1], "vectors_b64": b64, "dim": 2}),
                   422, "validation-error", "dim")
    assert_problem(client.post(f"/v1/collections/{name}/search", json={"vectors_b64": b64, "dim": 2}),
                   422, "validation-error", "dim")
    assert_problem(client.post(f"/v1/collections/{name}/search?dim=2&k=2", content=wrong.tobytes(),
                               headers={"content-type": "application/octet-stream"}), 422, "validation-error", "dim")
    assert_problem(client.post(f"/v1/collections/{name}/search",
                               json={"vectors": [[1.0] * DIM], "dim": DIM}), 422, "validation-error", "body")
    after = client.post(f"/v1/collections/{name}/search", json={"vector": [1.0, 0.0, 0.0, 0.0], "k": 2}).json()
    assert after["ids"] == before["ids"] and after["distances"] == before["distances"]  # nothing was overwritten
    right = np.eye(2, DIM, dtype="<f4")
    r = client.put(f"/v1/collections/{name}/points",
                   json={"ids": [0, 1], "vectors_b64": base64.b64encode(right.tobytes()).decode(), "dim": DIM})
    assert r.status_code == 200, r.text
    r = client.post(f"/v1/collections/{name}/search?dim={DIM}&k=1&consistency=strong", content=right[1].tobytes(),
                    headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["ids"] == [1], r.text
