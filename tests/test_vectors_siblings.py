"""Processes sharing a data directory (SWITCHYARD_WORKERS, engine processes) rebuild a collection one at a time
(indexes/build_lock.py), and the others take the snapshot that rebuild wrote (ResidentCollection.adopt) instead of
building the same index again: brought up to date from the change log in one step, never behind where they were."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from helpers import wait_job, wait_ready
from indexes.build_lock import BuildLock
from indexes.distance import exact_search
from indexes.faiss_index import FaissBackend
from indexes.resident import Changes, ResidentCollection
from vector_data import b64, clustered

DIM = 8
NONE = np.empty(0, np.int64)


def collection() -> ResidentCollection:
    return ResidentCollection("c", DIM, "l2", "hnsw", {"m": 16, "ef_construction": 40}, FaissBackend(threads=1))


def written(since: int, head: int, ids: np.ndarray, vectors: np.ndarray, deleted: np.ndarray = NONE) -> Changes:
    return Changes(since, head, deleted, ids, vectors)


def live_exact(r: ResidentCollection, queries: np.ndarray) -> np.ndarray:
    ids, vectors = r.live()
    return ids[exact_search(np, vectors, queries, 1, "l2")[1][:, 0]]


def test_an_adopted_snapshot_brought_up_to_date_equals_the_replica_that_applied_everything():
    data = clustered(3000, DIM, seed=5)
    builder, follower = collection(), collection()
    first = written(0, 5, np.arange(2000), data[:2000])
    for r in (builder, follower):
        r.apply(first)
    builder.rebuild()  # the other process's rebuild, and the snapshot it writes
    state = builder.state()
    later = written(5, 9, np.arange(2000, 3000), data[2000:], deleted=np.arange(0, 2000, 7))
    follower.apply(later)  # the follower went on meanwhile, without an index
    assert follower.index is None and follower.watermark == 9

    assert follower.adopt(state, later)
    builder.apply(later)
    assert follower.watermark == builder.watermark == 9 and follower.adopted == 1
    assert follower.content()["digest"] == builder.content()["digest"]
    assert follower.index is not None and follower.indexed_rows == 2000  # the snapshot's index, not a build here
    queries = data[np.arange(1, 3000, 3)]
    found = np.array(follower.search(queries, 1, {"ef": 256}).ids)[:, 0]
    assert (found == live_exact(follower, queries)).mean() > 0.99
    assert not set(found.tolist()) & set(range(0, 2000, 7))


def test_changes_that_do_not_start_at_the_snapshot_or_end_behind_the_replica_are_refused():
    data = clustered(400, DIM, seed=6)
    builder, follower = collection(), collection()
    for r in (builder, follower):
        r.apply(written(0, 3, np.arange(300), data[:300]))
    builder.rebuild()
    state = builder.state()
    follower.apply(written(3, 8, np.arange(300, 400), data[300:]))
    before = follower.content()
    assert not follower.adopt(state, written(4, 8, NONE, np.empty((0, DIM), np.float32)))  # a gap after seq 3
    assert not follower.adopt(state, written(3, 6, np.arange(300, 350), data[300:350]))  # ends before seq 8
    assert follower.content() == before and follower.index is None
    with pytest.raises(ValueError, match="digest"):  # rows that are not what the snapshot says it holds
        follower.adopt({**state, "digest": "0" * 16}, written(3, 8, np.arange(300, 400), data[300:]))
    assert follower.content() == before and follower.index is None


def test_the_build_lock_admits_one_holder_at_a_time(tmp_path):
    path = tmp_path / "locks" / "c.build-lock"
    order: list[str] = []

    async def hold(name: str, seconds: float) -> None:
        lock = BuildLock(path)
        await lock.acquire()
        order.append(f"{name} in")
        await asyncio.sleep(seconds)
        order.append(f"{name} out")
        lock.release()

    async def both() -> None:
        first = asyncio.ensure_future(hold("a", 0.3))
        await asyncio.sleep(0.05)
        await asyncio.gather(first, hold("b", 0.0))

    asyncio.run(both())
    assert order == ["a in", "a out", "b in", "b out"]


def replicas(client, name: str) -> list[dict]:
    r = client.get(f"/v1/collections/{name}", params={"verify": "true"})
    assert r.status_code == 200, r.text
    return r.json()["replication"]["replicas"]


@pytest.mark.parametrize("builds_through", ["a", "b"])
def test_workers_sharing_a_data_directory_build_once_and_the_other_takes_the_snapshot(make_client, tmp_path,
                                                                                       builds_through):
    shared, name = tmp_path / "shared", f"siblings-{builds_through}"
    a = make_client(data_dir=shared, workers=2)
    wait_ready(a)
    assert a.post("/v1/collections", json={"name": name, "dim": DIM, "index": {"type": "hnsw"},
                                           "pgvector_index": {"type": "none"}}).status_code == 201
    b = make_client(data_dir=shared, workers=2)
    wait_ready(b)
    data = clustered(3000, DIM, seed=7)
    before: dict[str, int] = {}  # each process's rebuilds so far (b's start-up load of the empty collection)
    for _ in range(100):
        before = {rep["process"]: rep["rebuilds"] for rep in replicas(a, name)}
        if len(before) == 2:
            break
        time.sleep(0.1)
    r = a.put(f"/v1/collections/{name}/points", json={"ids": list(range(3000)), "vectors_b64": b64(data)})
    assert r.status_code == 200, r.text
    first = a if builds_through == "a" else b
    built = first.post(f"/v1/collections/{name}/build")  # the other rebuilds in the background, or waits for this one
    assert built.status_code == 202, built.text
    assert wait_job(first, built.json()["location"])["state"] == "succeeded"

    def settled() -> list[dict]:
        for _ in range(300):
            reps = replicas(a, name)
            states = [client.get(f"/v1/collections/{name}").json()["index_state"] for client in (a, b)]
            if len(reps) == 2 and sum(rep["adopted"] for rep in reps) == 1 and all(
                    state["delta_rows"] == 0 for state in states):
                return reps
            time.sleep(0.1)
        raise AssertionError(replicas(a, name))

    reps = settled()
    assert sum(rep["rebuilds"] - before[rep["process"]] for rep in reps) == 1, reps  # one build between the two
    postgres = a.get(f"/v1/collections/{name}", params={"verify": "true"}).json()["replication"]["postgres"]
    assert all(rep["digest"] == postgres["digest"] for rep in reps), (reps, postgres)
    for client in (a, b):
        state = client.get(f"/v1/collections/{name}").json()["index_state"]
        assert state["index_type"] == "hnsw" and state["delta_rows"] == 0, state
        found = client.post(f"/v1/collections/{name}/search", json={"vectors_b64": b64(data[:200]), "k": 1,
                                                               "engine": "cpu", "params": {"ef": 128}}).json()
        assert sum(ids[0] == i for i, ids in enumerate(found["ids"])) >= 198
