"""switchyard_client against a real running service (issue 36): numpy round trips equal the JSON API's answers,
read-your-writes for a writer that never names a level (with 2 workers, and with 2 engine processes behind
fronts), typed errors with their field, bulk loads and jobs, spatial joins and SQL, the unix socket and asyncio."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from loadtests.processes import local_service
from switchyard_client import AsyncClient, Client, Conflict, InvalidRequest, NotFound, SearchResult

DIM = 8
# The service's default level is `eventually` here: a search that did not say `session` with its writer's seq
# could be answered by a process that has not applied that write yet.
EVENTUALLY = {"SWITCHYARD_CONSISTENCY": "eventually"}


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """`serve --workers 2`, also on a unix socket, closing connections idle for a second."""
    folder = tmp_path_factory.mktemp("client-workers")
    socket_path = Path(tempfile.mkdtemp(prefix="sy-client-")) / "sy.sock"  # short: unix socket paths are
    with local_service(2, folder / "data", folder / "serve.log",
                       env={**EVENTUALLY, "SWITCHYARD_UDS": str(socket_path), "SWITCHYARD_KEEP_ALIVE_S": "1"}) as url:
        yield url, socket_path


@pytest.fixture(scope="module")
def fronted(tmp_path_factory):
    """Two engine processes behind two front processes."""
    folder = tmp_path_factory.mktemp("client-fronted")
    with local_service(1, folder / "data", folder / "serve.log",
                       env={**EVENTUALLY, "SWITCHYARD_ENGINES": "2", "SWITCHYARD_FRONTS": "2"}) as url:
        yield url


def clustered(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(16, DIM)) * 4
    return (centres[rng.integers(0, 16, n)] + rng.normal(size=(n, DIM))).astype(np.float32)


def fresh(sy: Client, name: str, **kwargs) -> str:
    try:
        sy.delete_collection(name)
    except NotFound:
        pass
    sy.create_collection(name, dim=DIM, **kwargs)
    return name


def test_numpy_round_trips_equal_the_json_api(workers):
    url, _ = workers
    vectors = clustered(500)
    payloads = [{"group": i % 3} for i in range(500)]
    with Client(url, transport="http") as sy, httpx.Client(base_url=url, timeout=60) as plain:
        name = fresh(sy, "rt")
        written = sy.upsert(name, np.arange(500), vectors, payloads)
        assert written.upserted == 500 and written.seq is not None
        queries = vectors[:5] + 0.01
        for engine in ("cpu", "pgvector"):
            batch = sy.search(name, queries, k=7, engine=engine, consistency="strong")
            assert isinstance(batch, SearchResult) and batch.ids.shape == (5, 7) and batch.ids.dtype == np.int64
            answer = plain.post(f"/v1/collections/{name}/search", json={
                "vectors": queries.tolist(), "k": 7, "engine": engine, "consistency": "strong"}).json()
            np.testing.assert_array_equal(batch.ids, np.asarray(answer["ids"]))
            np.testing.assert_allclose(batch.distances, np.asarray(answer["distances"], np.float32), rtol=1e-6)
            one = sy.search(name, queries[0], k=7, engine=engine, consistency="strong")
            assert one.ids.shape == (7,)
            np.testing.assert_array_equal(one.ids, batch.ids[0])
        # A filter that leaves fewer than k: the rows are padded with -1 and inf.
        filtered = sy.search(name, queries[:2], k=400, filter={"group": 1}, consistency="strong")
        expected = plain.post(f"/v1/collections/{name}/search", json={
            "vectors": queries[:2].tolist(), "k": 400, "filter": {"group": 1}, "consistency": "strong"}).json()
        assert filtered.ids.shape == filtered.distances.shape == (2, 400)  # k columns, however many matched
        for row, ids in enumerate(expected["ids"]):
            assert list(filtered.ids[row, :len(ids)]) == ids
            assert (filtered.ids[row, len(ids):] == -1).all() and np.isinf(filtered.distances[row, len(ids):]).all()
        for match in ({"group": 1}, {"group": 7}):  # a single query too, and one nothing matches
            one = sy.search(name, queries[0], k=400, filter=match, consistency="strong")
            assert one.ids.shape == one.distances.shape == (400,)
            found = int((one.ids != -1).sum())
            assert found == (len(expected["ids"][0]) if match["group"] == 1 else 0)
            assert np.isinf(one.distances[found:]).all()
        deleted = sy.delete(name, [0, 1, 10_000])
        assert deleted.deleted == 2 and deleted.seq > written.seq
        assert 0 not in sy.search(name, vectors[0], k=3).ids


def read_your_writes(sy: Client, name: str, rounds: int) -> None:
    """Write a point far from every other, then at once search for it, `rounds` times, naming no level."""
    for i in range(rounds):
        vector = np.full(DIM, 1000.0 + i, np.float32)
        written = sy.upsert(name, [10_000 + i], vector[None, :])
        hits = sy.search(name, vector, k=1)
        assert hits.consistency == "session", hits  # the client asked for its session
        # A resident replica answered at or past the write's seq; pgvector (the fallback while a process's replica
        # still loads) reads PostgreSQL itself and has no watermark.
        assert hits.engine == "pgvector" or (hits.watermark is not None and hits.watermark >= written.seq), hits
        assert hits.ids.tolist() == [10_000 + i], f"round {i}: the search missed the write it followed"


@pytest.mark.parametrize("where", ["workers", "fronted"])
def test_a_writer_that_names_no_level_reads_its_writes_from_any_process(where, request):
    url = request.getfixturevalue("workers")[0] if where == "workers" else request.getfixturevalue("fronted")
    # No idle connection kept: each call may land on either process.
    with Client(url, transport="http", max_idle_connections=0) as sy:
        name = fresh(sy, f"ryw_{where}")
        sy.upsert(name, np.arange(200), clustered(200))
        read_your_writes(sy, name, 30)
        # An explicit level overrides the session's, and another client knows nothing of this one's writes.
        assert sy.search(name, np.zeros(DIM), k=1, consistency="eventually").consistency == "eventually"
        # "default" sends no level: the service's own default (eventually here), not this client's session
        assert sy.search(name, np.zeros(DIM), k=1, consistency="default").consistency == "eventually"
    with Client(url, transport="http") as other:
        assert other.search(name, np.zeros(DIM), k=1).consistency == "eventually"


def test_errors_are_typed_and_carry_the_field(workers):
    url, _ = workers
    with Client(url, transport="http") as sy:
        name = fresh(sy, "errors")
        with pytest.raises(Conflict):
            sy.create_collection(name, dim=DIM)
        with pytest.raises(NotFound):
            sy.search("no_such_collection", np.zeros(DIM))
        with pytest.raises(InvalidRequest) as bad:
            sy.search(name, np.zeros(DIM), k=0)
        assert bad.value.field == "k" and bad.value.status == 422
        with pytest.raises(InvalidRequest) as bad:
            sy.upsert(name, [1], np.ones((1, DIM + 1)))
        assert bad.value.field == "vectors" and f"dimension {DIM + 1}" in str(bad.value)
        # bytes of the right count, cut differently: once stored as 2 rows of DIM, searched as 4 queries
        with pytest.raises(InvalidRequest) as bad:
            sy.upsert(name, [1, 2], np.ones((4, DIM // 2)))
        assert bad.value.field == "vectors" and bad.value.problem["field"] == "dim"
        with pytest.raises(InvalidRequest) as bad:
            sy.search(name, np.ones((4, DIM // 2)), k=1)
        assert bad.value.field == "vectors" and f"dimension {DIM // 2}" in str(bad.value)
        with pytest.raises(InvalidRequest) as bad:
            sy.upsert(name, [1], np.full((1, DIM), np.nan))
        assert bad.value.field.startswith("vectors[") and sy.get_collection(name)["count"] == 0
        with pytest.raises(InvalidRequest) as bad:
            sy.upsert(name, [1], np.ones((1, DIM)), payloads=[{"big": 2**64}])
        assert bad.value.field == "payloads[0]"


@pytest.mark.parametrize("transport", ["http", "pycurl"])
def test_a_bulk_load_through_arrow_is_followed_to_its_end(workers, transport):
    url, _ = workers
    seen: list[tuple[int, int]] = []
    vectors = clustered(3000, seed=3)
    with Client(url, transport=transport) as sy:
        name = fresh(sy, f"bulk_{transport}")
        result = sy.load(name, np.arange(3000), vectors, [{"n": i} for i in range(3000)],
                         progress=lambda done, total, message: seen.append((done, total)))
        assert result["upserted"] == 3000 and result["seq"] is not None
        assert seen and seen[-1][1] == 3000
        assert sy.get_collection(name)["count"] == 3000
        hits = sy.search(name, vectors[42], k=1)  # read-your-writes covers the load too
        assert hits.ids.tolist() == [42] and hits.consistency == "session"
        sy.build(name)
        recall = sy.recall(name, sample=50, k=10)
        assert 0.9 <= recall["recall"] <= 1.0
        # The stream is spooled to a file and sent from it; a request after it carries its own body again.
        assert sy.upsert(name, [5000], vectors[:1]).upserted == 1


@pytest.mark.parametrize("transport", ["http", "pycurl"])
def test_the_unix_socket_gives_the_same_answers_as_tcp(workers, transport):
    url, socket_path = workers
    if transport == "pycurl":
        pytest.importorskip("pycurl")
    vectors = clustered(100, seed=5)
    with Client(url, transport="http") as tcp, Client(f"unix:{socket_path}", transport=transport) as local:
        name = fresh(tcp, f"uds_{transport}")
        tcp.upsert(name, np.arange(100), vectors)
        a = tcp.search(name, vectors[:3], k=5)
        local_write = local.upsert(name, [500], vectors[:1] + 100)
        b = local.search(name, vectors[:3], k=5, consistency="strong")
        np.testing.assert_array_equal(a.ids, b.ids)
        after = local.search(name, vectors[0] + 100, k=1)  # the session reads its write back, whichever engine answers
        assert after.ids.tolist() == [500]
        assert after.watermark is None or after.watermark >= local_write.seq  # None: pgvector answered (the resident
        # replica of the worker that took it was still catching up, which `auto` routes around)
        with pytest.raises(InvalidRequest):
            local.search(name, vectors[0], k=0)


def test_the_async_client_answers_as_the_blocking_one(workers):
    url, _ = workers
    vectors = clustered(200, seed=7)

    async def scenario() -> None:
        async with AsyncClient(url) as sy:
            name = "async_rt"
            try:
                await sy.delete_collection(name)
            except NotFound:
                pass
            await sy.create_collection(name, dim=DIM)
            await sy.upsert(name, np.arange(200), vectors)
            answers = await asyncio.gather(*(sy.search(name, vectors[i], k=3) for i in range(20)))
            assert [a.ids[0] for a in answers] == list(range(20))
            assert all(a.consistency == "session" for a in answers)
            with pytest.raises(InvalidRequest) as bad:
                await sy.search(name, vectors[0], k=0)
            assert bad.value.field == "k"
            loaded = await sy.load(name, np.arange(1000, 1200), vectors + 50, progress=False)
            assert loaded["upserted"] == 200
            assert (await sy.search(name, vectors[7] + 50, k=1)).ids.tolist() == [1007]

    asyncio.run(scenario())
    with Client(url, transport="http") as sy:
        np.testing.assert_array_equal(sy.search("async_rt", vectors[:20], k=3).ids[:, 0], np.arange(20))


def test_spatial_joins_come_back_as_arrays(workers):
    url, _ = workers
    with Client(url, transport="http") as sy:
        for layer in ("cl_points", "cl_polys"):
            try:
                sy.delete_layer(layer)
            except NotFound:
                pass
        lon = np.array([0.5, 1.5, 0.25, 5.0])
        lat = np.array([0.5, 0.5, 0.75, 5.0])
        sy.create_points("cl_points", lon, lat, ids=[10, 11, 12, 13])
        sy.create_polygons("cl_polys", ["POLYGON((0 0, 1 0, 1 1, 0 1, 0 0))", "POLYGON((1 0, 2 0, 2 1, 1 1, 1 0))"],
                           ids=[1, 2])
        polygon_ids, counts = sy.point_in_polygon_counts("cl_points", "cl_polys", engine="cpu")
        assert dict(zip(polygon_ids.tolist(), counts.tolist())) == {1: 2, 2: 1}
        pairs = sy.point_in_polygon("cl_points", "cl_polys", engine="cpu", page_size=1)  # one point per page
        assert sorted(zip(pairs.left.tolist(), pairs.right.tolist())) == [(10, 1), (11, 2), (12, 1)]
        near = sy.within_distance("cl_points", "cl_points", 40_000, engine="cpu")
        assert sorted(zip(near.left.tolist(), near.right.tolist())) == [(10, 12)]
        assert near.distances_m is not None and 0 < near.distances_m[0] < 40_000


@pytest.mark.parametrize("transport", ["http", "pycurl"])
def test_connections_the_service_closed_for_idleness_are_replaced(workers, transport):
    url, _ = workers
    if transport == "pycurl":
        pytest.importorskip("pycurl")
    with Client(url, transport=transport) as sy:
        name = fresh(sy, f"idle_{transport}")
        sy.upsert(name, [1], np.ones((1, DIM)))
        for _ in range(2):
            time.sleep(1.5)  # past SWITCHYARD_KEEP_ALIVE_S: the service has closed the pooled connection
            assert sy.search(name, np.ones(DIM), k=1).ids.tolist() == [1]
            time.sleep(1.5)
            sy.delete_collection(name)
            sy.create_collection(name, dim=DIM)  # not idempotent: never sent on a connection that may be stale
            sy.upsert(name, [1], np.ones((1, DIM)))
