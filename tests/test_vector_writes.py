"""The write path's throughput features: group commit (concurrent small upserts share transactions, answer as if
run one after another, acknowledged only once committed) and pgvector's fallback index built in the background."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from helpers import wait_job, wait_ready
from indexes.group_commit import GroupCommit, merge
from indexes.vectors import Points
from vector_data import clustered


def points(ids: list[int], value: float, payload: bytes | None = None) -> Points:
    vectors = np.full((len(ids), 2), value, np.float32)
    return Points(np.array(ids, np.int64), vectors, None if payload is None else [payload] * len(ids))


def test_merge_keeps_the_last_version_of_each_id_in_arrival_order():
    merged = merge([points([1, 2], 1.0), points([3, 1], 2.0, b'{"a":1}'), points([2], 3.0)])
    assert merged.ids.tolist() == [3, 1, 2]
    assert merged.vectors[:, 0].tolist() == [2.0, 2.0, 3.0]
    assert merged.payloads == [b'{"a":1}', b'{"a":1}', None]
    alone = points([5], 1.0)
    assert merge([alone]) is alone


def test_concurrent_upserts_share_a_write_and_failures_stay_their_own():
    writes: list[list[int]] = []

    async def write(p: Points) -> int:
        await asyncio.sleep(0.01)  # the transaction: others queue meanwhile
        if 666 in p.ids:
            raise ValueError("bad row")
        writes.append(p.ids.tolist())
        return len(writes)

    async def run() -> None:
        group = GroupCommit(write, max_rows=5)
        first = asyncio.create_task(group.upsert(points([0], 0.0)))
        await asyncio.sleep(0)  # the first goes alone
        rest = [asyncio.create_task(group.upsert(points([i], 0.0))) for i in range(1, 8)]
        seqs = await asyncio.gather(first, *rest)
        assert writes == [[0], [1, 2, 3, 4, 5], [6, 7]]  # at most max_rows rows a group, in arrival order
        assert seqs == [1, 2, 2, 2, 2, 2, 3, 3]  # every request acknowledged with its group's commit
        writes.clear()
        good = asyncio.create_task(group.upsert(points([10], 0.0)))
        await asyncio.sleep(0)
        grouped = [asyncio.create_task(group.upsert(points([i], 0.0))) for i in (11, 666, 12)]
        results = await asyncio.gather(good, *grouped, return_exceptions=True)
        assert isinstance(results[2], ValueError)  # only the request with the bad row fails
        assert [r for i, r in enumerate(results) if i != 2] == [1, 2, 3]
        assert writes == [[10], [11], [12]]  # the failed group was retried one request at a time

    asyncio.run(run())


def test_service_groups_concurrent_upserts_and_stores_each_acknowledged_vector(client):
    wait_ready(client)
    dim = 8
    assert client.post("/v1/collections", json={"name": "gc", "dim": dim}).status_code == 201
    data = clustered(48, dim, seed=3)
    answers: dict[int, dict] = {}
    barrier = threading.Barrier(len(data))

    def upsert(i: int) -> None:
        barrier.wait()
        r = client.put("/v1/collections/gc/points", json={"ids": [i], "vectors": [data[i].tolist()],
                                                          "payloads": [{"i": i}]})
        assert r.status_code == 200, r.text
        answers[i] = r.json()

    threads = [threading.Thread(target=upsert, args=(i,)) for i in range(len(data))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    group = client.app.state.switchyard.vectors.write_groups["gc"]
    assert group.requests == len(data)
    assert group.groups < len(data)  # some upserts shared a transaction
    for i, answer in answers.items():  # read your write at the seq the ack gave, vector and payload
        r = client.post("/v1/collections/gc/search", json={"vector": data[i].tolist(), "k": 1,
                                                           "consistency": "session", "seq": answer["seq"],
                                                           "filter": {"i": i}})
        assert r.json()["ids"] == [i] and r.json()["distances"][0] == pytest.approx(0, abs=1e-2)
    for engine in ("cpu", "pgvector"):
        r = client.post("/v1/collections/gc/search", json={"vectors": data.tolist(), "k": 1, "engine": engine,
                                                           "consistency": "strong"})
        assert [ids[0] for ids in r.json()["ids"]] == list(range(len(data)))
    assert client.get("/v1/collections/gc").json()["count"] == len(data)


def test_a_build_that_waits_for_pgvector_builds_both_indexes_side_by_side(client, monkeypatch):
    """With pgvector=wait the resident index and pgvector's are built at once (one after the other, a load took
    their sum): pgvector's build starts while the resident rebuild is still running."""
    from indexes import manager_builds, pgvector_search

    events: list[str] = []
    real_resident, real_pgvector = manager_builds.Builds.rebuild_resident, pgvector_search.build_index

    async def resident(self, name, say=None):
        events.append("resident started")
        await asyncio.sleep(0.3)  # long enough for the other build to start, if it runs beside this one
        try:
            return await real_resident(self, name, say)
        finally:
            events.append("resident done")

    async def pgvector(*args, **kwargs):
        events.append("pgvector started")
        return await real_pgvector(*args, **kwargs)

    monkeypatch.setattr(manager_builds.Builds, "rebuild_resident", resident)
    monkeypatch.setattr(pgvector_search, "build_index", pgvector)
    wait_ready(client)
    data = clustered(2000, 8, seed=5)
    assert client.post("/v1/collections", json={"name": "both", "dim": 8, "index": {"type": "hnsw"}}).status_code == 201
    assert client.put("/v1/collections/both/points",
                      json={"ids": list(range(2000)), "vectors": data.tolist()}).status_code == 200
    state = wait_job(client, client.post("/v1/collections/both/build?pgvector=wait").json()["location"], 60)
    assert state["state"] == "succeeded", state
    assert state["result"]["resident_index"] == "hnsw" and state["result"]["pgvector_index"] == "hnsw"
    assert events.index("pgvector started") < events.index("resident done"), events
    r = client.post("/v1/collections/both/search", json={"vector": data[11].tolist(), "k": 1, "engine": "pgvector"})
    assert r.json()["ids"] == [11]


def test_the_background_pgvector_build_yields_the_cpu_in_one_backend_closed_after(client, monkeypatch):
    """Where PostgreSQL's processes are the service's own (embedded), the background build runs in one backend
    (no parallel workers) whose CPU priority the service lowers, its scheduling group's too (autogroup); that backend
    is not used again."""
    import os

    import psutil

    from service.admission.priority import BACKGROUND_NICE, lower_process_priority

    wait_ready(client)
    vectors = client.app.state.switchyard.vectors
    seen: list[tuple[int, bool, int, int]] = []  # pid, whether it is a local postgres of ours, nice before, after
    groups: list[str] = []  # its scheduling group's nice value after, where the kernel groups sessions

    def lower(pid: int) -> None:
        ours = psutil.pid_exists(pid) and psutil.Process(pid).name() == "postgres"
        before = os.getpriority(os.PRIO_PROCESS, pid) if ours else 0
        lower_process_priority(pid)
        seen.append((pid, ours, before, os.getpriority(os.PRIO_PROCESS, pid) if ours else 0))
        if ours and os.path.exists(f"/proc/{pid}/autogroup"):
            groups.append(open(f"/proc/{pid}/autogroup").read().split()[-1])

    monkeypatch.setattr(vectors, "lower_database_process", lower)
    data = clustered(2000, 8, seed=8)
    assert client.post("/v1/collections", json={"name": "nice", "dim": 8, "index": {"type": "hnsw"}}).status_code == 201
    assert client.put("/v1/collections/nice/points",
                      json={"ids": list(range(2000)), "vectors": data.tolist()}).status_code == 200
    state = wait_job(client, client.post("/v1/collections/nice/build").json()["location"], 60)
    assert state["state"] == "succeeded" and state["result"]["pgvector_index"] == "building", state
    deadline = time.monotonic() + 60
    while client.get("/v1/collections/nice").json()["index_state"]["pgvector_index"] is not True:
        assert time.monotonic() < deadline, "the background pgvector index never became valid"
        time.sleep(0.1)
    [(pid, ours, before, after)] = seen
    if ours:  # these tests' own server (not SWITCHYARD_TEST_DATABASE_URL's, elsewhere)
        assert after == max(before, BACKGROUND_NICE)
        assert groups in ([], [str(after)])  # a backend leads its own session: its group is lowered too
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:  # terminated after
        assert time.monotonic() < deadline, f"backend {pid} still runs after its build"
        time.sleep(0.1)
    for i in (3, 1500):  # the pool serves on, on backends of their usual priority
        r = client.post("/v1/collections/nice/search", json={"vector": data[i].tolist(), "k": 1, "engine": "pgvector"})
        assert r.status_code == 200 and r.json()["ids"] == [i], r.text


def test_pgvector_fallback_index_builds_in_the_background_while_writes_go_on(client):
    wait_ready(client)
    dim = 8
    assert client.post("/v1/collections", json={"name": "fb", "dim": dim, "index": {"type": "hnsw"}}).status_code == 201
    data = clustered(3000, dim, seed=4)
    assert client.put("/v1/collections/fb/points",
                      json={"ids": list(range(3000)), "vectors": data.tolist()}).status_code == 200
    state = wait_job(client, client.post("/v1/collections/fb/build").json()["location"], 60)
    deadline = time.monotonic() + 60
    assert state["state"] == "succeeded", state
    assert state["result"]["resident_index"] == "hnsw"
    assert state["result"]["pgvector_index"] == "building" and "pgvector_build_s" not in state["result"]
    # the job did not wait for pgvector's index; a write meanwhile is not held up by it
    assert client.put("/v1/collections/fb/points",
                      json={"ids": [5000], "vectors": [data[0].tolist()]}).status_code == 200
    while client.get("/v1/collections/fb").json()["index_state"]["pgvector_index"] != True:  # noqa: E712
        assert time.monotonic() < deadline, "the background pgvector index never became valid"
        time.sleep(0.1)
    r = client.post("/v1/collections/fb/search", json={"vector": data[7].tolist(), "k": 1, "engine": "pgvector"})
    assert r.json()["ids"] == [7]
    waited = client.post("/v1/collections/fb/build?pgvector=wait").json()  # nothing missing now: no pgvector step
    assert waited["state"] in ("queued", "running", "succeeded")
