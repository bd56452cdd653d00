"""Every resident replica is a faithful copy of PostgreSQL: writes taken by another process arrive through the
change log, one rebuild at a time, a failure between commit and apply is repaired, empty answers are answers,
snapshots are validated against PostgreSQL's history, and searches honour their consistency level.

Two apps on one database stand for two processes (Uvicorn workers or two `switchyard serve`); each has its
own follower (LISTEN connection and poll), exactly as separate processes do.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
import zipfile

import asyncpg
import numpy as np
import pytest

from conftest import run
from helpers import assert_problem, wait_ready
from indexes.resident import ResidentCollection
from indexes.store import CollectionStore
from vector_data import b64

DIM = 8
RNG = np.random.default_rng(3)
DATA = RNG.standard_normal((3000, DIM)).astype(np.float32)


def app(make_client, tmp_path, label: str, **overrides):
    client = make_client(data_dir=tmp_path / label, **overrides)
    wait_ready(client)
    return client


def create(client, name: str, **extra) -> None:
    r = client.post("/v1/collections", json={"name": name, "dim": DIM, "index": {"type": "brute_force"},
                                             "pgvector_index": {"type": "none"}, **extra})
    assert r.status_code == 201, r.text


def upsert(client, name: str, ids, vectors) -> int:
    r = client.put(f"/v1/collections/{name}/points", json={"ids": [int(i) for i in ids], "vectors_b64": b64(vectors)})
    assert r.status_code == 200, r.text
    return r.json()["seq"]


def delete(client, name: str, ids) -> dict:
    r = client.post(f"/v1/collections/{name}/points/delete", json={"ids": [int(i) for i in ids]})
    assert r.status_code == 200, r.text
    return r.json()


def top1(client, name: str, vectors: np.ndarray, **extra) -> tuple[list[int | None], list[float | None], dict]:
    r = client.post(f"/v1/collections/{name}/search", json={"vectors_b64": b64(vectors), "k": 1, "engine": "cpu",
                                                            **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    return ([i[0] if i else None for i in body["ids"]], [d[0] if d else None for d in body["distances"]], body)


def eventually(holds, timeout_s: float = 5.0) -> None:
    """Wait until holds() is true (an AssertionError inside counts as not yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if holds():
                return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError("did not happen in time")
        time.sleep(0.05)


def replication(client, name: str) -> dict:
    r = client.get(f"/v1/collections/{name}", params={"verify": "true"})
    assert r.status_code == 200, r.text
    return r.json()["replication"]


def assert_in_step(client, name: str, processes: int) -> bool:
    """Every process's replica holds what PostgreSQL holds."""
    rep = replication(client, name)
    assert len(rep["replicas"]) == processes, rep
    for replica in rep["replicas"]:
        assert (replica["digest"], replica["rows"], replica["lag_rows"]) == (
            rep["postgres"]["digest"], rep["postgres"]["rows"], 0), rep
    return True


# -- 1: a write taken by one process reaches every other one ---------------------------------------------
def test_writes_through_one_process_reach_the_others(make_client, tmp_path):
    a = app(make_client, tmp_path, "a")
    create(a, "shared")
    b = app(make_client, tmp_path, "b")  # holds the collection from its start-up
    upsert(a, "shared", range(2000), DATA[:2000])
    for start in range(0, 1000, 100):  # deletes in batches, through both processes
        delete(a if start % 200 else b, "shared", range(start, start + 100))
    live, gone = np.arange(1000, 2000), np.arange(1000)

    def in_step_by_themselves() -> bool:  # the default level: no client-side help
        for reader in (a, b):
            found, dist, _ = top1(reader, "shared", np.concatenate([DATA[live], DATA[gone]]))
            if found[:1000] != live.tolist() or max(dist[:1000]) > 1e-4 or set(found[1000:]) & set(gone.tolist()):
                return False
        return True

    eventually(in_step_by_themselves, timeout_s=3)
    for reader in (a, b):
        found, dist, body = top1(reader, "shared", DATA[live], consistency="strong")
        assert found == live.tolist() and max(dist) < 1e-4 and body["watermark"] >= 1
        found, _, _ = top1(reader, "shared", DATA[gone], consistency="strong")
        assert not set(found) & set(gone.tolist())
    # A collection created by one process is resident in the other too, and eventually in step by itself.
    create(b, "made-in-b")
    seq = upsert(b, "made-in-b", [7], DATA[[7]])
    eventually(lambda: top1(a, "made-in-b", DATA[[7]], consistency="eventually")[0] == [7])
    assert top1(a, "made-in-b", DATA[[7]], consistency="session", seq=seq)[0] == [7]
    eventually(lambda: assert_in_step(a, "shared", processes=2))


def test_large_and_small_catch_ups_read_the_same_log(make_client, tmp_path):
    """Over FEW_ROWS changed rows a catch-up reads with COPY in a transaction, under it in one statement."""
    a = app(make_client, tmp_path, "a")
    create(a, "sizes", metric="cosine")
    b = app(make_client, tmp_path, "b")
    upsert(a, "sizes", range(2500), DATA[:2500])  # one commit of 2,500 rows: the COPY path in b
    assert top1(b, "sizes", DATA[:2500], consistency="strong")[0] == list(range(2500))
    upsert(a, "sizes", range(10), DATA[2500:2510])  # small: one statement
    delete(a, "sizes", range(10, 20))
    found, _, _ = top1(b, "sizes", DATA[2500:2510], consistency="strong")
    assert found == list(range(10))
    eventually(lambda: assert_in_step(b, "sizes", processes=2))


def test_a_dropped_and_recreated_collection_is_followed(make_client, tmp_path):
    a, b = app(make_client, tmp_path, "a"), app(make_client, tmp_path, "b")
    create(a, "again")
    upsert(a, "again", range(10), DATA[:10])
    assert top1(b, "again", DATA[:10], consistency="strong")[0] == list(range(10))
    assert a.delete("/v1/collections/again").status_code == 204
    create(a, "again")  # same name, new collection
    upsert(b, "again", [1], DATA[[100]])  # b's cached definition was of the dropped one
    assert top1(a, "again", DATA[[100]], consistency="strong")[0] == [1]
    eventually(lambda: top1(b, "again", DATA[:1], consistency="strong")[0] == [1])  # only point 1, new vector
    assert b.get("/v1/collections/again").json()["count"] == 1


# -- 2: one rebuild at a time, and changes during a rebuild carried over by id ---------------------------
class SlowBackend:
    """Wraps the engine's backend: every build takes `seconds`, and the most builds running at once is kept."""

    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds
        self.name, self.kind = inner.name, inner.kind
        self.running = self.most = 0
        self.lock = threading.Lock()

    def build(self, config, vectors):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.seconds)
            return self.inner.build(config, vectors)
        finally:
            with self.lock:
                self.running -= 1

    def load(self, config, data):
        return self.inner.load(config, data)


def test_one_rebuild_at_a_time_and_no_write_lost_during_it(make_client, tmp_path):
    client = app(make_client, tmp_path, "a")
    create(client, "rebuilt")
    upsert(client, "rebuilt", range(1000), DATA[:1000])
    replica = client.app.state.switchyard.vectors.resident["rebuilt"]
    slow = replica.index.backend = SlowBackend(replica.index.backend, 0.6)
    job = client.post("/v1/collections/rebuilt/build").json()
    time.sleep(0.1)  # the asked-for rebuild is running
    for start in range(0, 300, 100):  # enough dead rows for a background rebuild, while it runs
        delete(client, "rebuilt", range(start, start + 100))
    upsert(client, "rebuilt", range(1000, 1100), DATA[1000:1100])  # written during the rebuild
    upsert(client, "rebuilt", range(500, 510), DATA[2000:2010])  # replaced during the rebuild
    for _ in range(1200):  # a minute at most, for a loaded machine
        if client.get(f"/v1/jobs/{job['job']}").json()["state"] in ("succeeded", "failed"):
            break
        time.sleep(0.05)
    assert client.get(f"/v1/jobs/{job['job']}").json()["state"] == "succeeded"
    eventually(lambda: client.get("/v1/collections/rebuilt").json()["index_state"]["rebuilding"] is False)
    assert slow.most == 1
    live = np.r_[300:500, 510:1100]
    assert top1(client, "rebuilt", DATA[live])[0] == live.tolist()
    assert top1(client, "rebuilt", DATA[2000:2010])[0] == list(range(500, 510))
    found, distances, _ = top1(client, "rebuilt", DATA[np.r_[0:300, 500:510]])
    assert not set(found) & set(range(300)) and min(distances) > 1e-3  # deleted, or replaced: nowhere any more
    assert_in_step(client, "rebuilt", processes=1)


def test_a_build_asked_of_a_process_covers_writes_it_has_not_heard_of(make_client, tmp_path):
    """A build asked of one worker right after writes through another covers them, whether or not that worker
    has followed them yet (it built what it held, and the writes waited for a background rebuild)."""
    a = app(make_client, tmp_path, "a")
    create(a, "unheard", index={"type": "hnsw"})
    b = app(make_client, tmp_path, "b", replication_poll_ms=60_000)  # only notifications bring changes in
    upsert(a, "unheard", range(500), DATA[:500])
    eventually(lambda: replication(b, "unheard")["replicas"][0]["rows"] == 500)
    vectors = b.app.state.switchyard.vectors
    deaf = type("Deaf", (), {"__getattr__": lambda self, attr: lambda *args: None})()
    vectors.follower.handler = deaf  # b hears of nothing from now on
    upsert(a, "unheard", range(500, 2500), DATA[500:2500])
    job = b.post("/v1/collections/unheard/build").json()
    eventually(lambda: b.get(f"/v1/jobs/{job['job']}").json()["state"] == "succeeded", timeout_s=60)
    index = vectors.resident["unheard"].index
    assert (index.count, index.delta_rows, index.index.size) == (2500, 0, 2500)
    found = top1(b, "unheard", DATA[:2500], consistency="eventually", params={"ef": 128})[0]
    assert sum(i == j for i, j in enumerate(found)) >= 2450  # HNSW: approximate


# -- 3: a failure between PostgreSQL's commit and the replica's update is repaired ----------------------
def test_an_engine_failure_after_commit_is_repaired_by_the_next_catch_up(make_client, tmp_path, monkeypatch):
    client = app(make_client, tmp_path, "a")
    create(client, "faulty")
    upsert(client, "faulty", range(100), DATA[:100])
    grow = ResidentCollection._grow
    failures = []

    def fail_once(self, extra):
        if not failures:
            failures.append(extra)
            raise MemoryError("injected: the engine failed after the commit")
        return grow(self, extra)

    monkeypatch.setattr(ResidentCollection, "_grow", fail_once)
    r = client.put("/v1/collections/faulty/points",
                   json={"ids": list(range(100, 200)), "vectors_b64": b64(DATA[100:200])})
    assert failures and r.status_code == 200  # committed, so acknowledged
    # The next catch-up (the follower's, at once) brings it in; a strong search never misses it.
    assert top1(client, "faulty", DATA[100:200], consistency="strong")[0] == list(range(100, 200))
    assert_in_step(client, "faulty", processes=1)


def test_a_connection_lost_after_commit_is_repaired(make_client, tmp_path, monkeypatch):
    client = app(make_client, tmp_path, "a", raise_server_exceptions=False)
    create(client, "dropped")
    original = CollectionStore.upsert

    async def commit_then_lose_the_connection(self, c, points):
        await original(self, c, points)
        raise asyncpg.ConnectionDoesNotExistError("injected: connection was closed after the commit")

    monkeypatch.setattr(CollectionStore, "upsert", commit_then_lose_the_connection)
    client_errors = client.put("/v1/collections/dropped/points", json={"ids": [1, 2], "vectors_b64": b64(DATA[1:3])})
    assert client_errors.status_code >= 500  # the client cannot know; PostgreSQL has it
    monkeypatch.setattr(CollectionStore, "upsert", original)
    eventually(lambda: top1(client, "dropped", DATA[1:3])[0] == [1, 2])
    assert_in_step(client, "dropped", processes=1)


# -- 4: an empty collection, or a filter nothing passes, is an empty answer on every engine -------------
@pytest.mark.parametrize("engine", ["cpu", "pgvector", "auto"])
def test_empty_answers_are_answers(make_client, tmp_path, engine):
    client = app(make_client, tmp_path, "a")
    name = f"empty-{engine}"
    create(client, name)
    for body in ({"vector": DATA[0].tolist()}, {"vectors": DATA[:3].tolist()}):
        r = client.post(f"/v1/collections/{name}/search", json={**body, "k": 5, "engine": engine})
        assert r.status_code == 200, r.text
        assert r.json()["ids"] in ([], [[], [], []]) and r.json()["engine"] != "pgvector" or engine == "pgvector"
    r = client.put(f"/v1/collections/{name}/points", json={"ids": [1, 2], "vectors": DATA[:2].tolist(),
                                                          "payloads": [{"tag": "a"}, {"tag": "b"}]})
    assert r.status_code == 200
    for flt in ({"tag": "z"}, {"other": 1}):
        r = client.post(f"/v1/collections/{name}/search", json={"vector": DATA[0].tolist(), "k": 5, "engine": engine,
                                                                "filter": flt})
        assert r.status_code == 200 and r.json()["ids"] == [], r.text
    delete(client, name, [1, 2])
    r = client.post(f"/v1/collections/{name}/search", json={"vectors": DATA[:2].tolist(), "k": 3, "engine": engine})
    assert r.status_code == 200 and r.json()["ids"] == [[], []], r.text


# -- snapshots: validated, and discarded when PostgreSQL does not have their history --------------------
def restart(make_client, tmp_path, client):
    client.__exit__(None, None, None)
    return app(make_client, tmp_path, "a")


def test_a_snapshot_ahead_of_postgres_is_discarded(make_client, tmp_path, database_url):
    client = app(make_client, tmp_path, "a")
    create(client, "restored")
    s1 = upsert(client, "restored", range(100), DATA[:100])
    upsert(client, "restored", range(100, 150), DATA[100:150])
    client = restart(make_client, tmp_path, client)  # saved a snapshot covering both writes at shutdown
    assert client.get("/v1/collections/restored").json()["index_state"]["loaded_from"] == "snapshot"
    client.__exit__(None, None, None)

    async def restore_backup_taken_at(seq: int, with_sequence: bool) -> None:
        """What restoring a backup taken right after commit `seq` does to the collection's rows and log."""
        conn = await asyncpg.connect(database_url)
        cid = await conn.fetchval("SELECT id FROM vector_collections WHERE name = 'restored'")
        await conn.execute(f"DELETE FROM vectors_{cid} WHERE seq > $1", seq)
        await conn.execute("DELETE FROM vector_commits WHERE collection_id = $1 AND seq > $2", cid, seq)
        if with_sequence:  # a restored sequence hands the same seqs out again
            await conn.execute("SELECT setval('vector_change_seq', $1)", seq)
        await conn.close()

    run(restore_backup_taken_at(s1, with_sequence=False))
    client = app(make_client, tmp_path, "a")
    info = client.get("/v1/collections/restored").json()
    assert info["index_state"]["loaded_from"] == "postgres" and info["count"] == 100
    found = top1(client, "restored", DATA[100:150], consistency="strong")[0]
    assert not set(found) & set(range(100, 150))
    client = restart(make_client, tmp_path, client)  # a snapshot at s1, valid
    t1 = upsert(client, "restored", range(500, 503), DATA[500:503])
    client = restart(make_client, tmp_path, client)  # a snapshot at t1
    client.__exit__(None, None, None)

    # Restored again to s1, sequence included; then another process's history goes past t1 without a commit at t1.
    run(restore_backup_taken_at(s1, with_sequence=True))
    other = app(make_client, tmp_path, "b")
    past = upsert(other, "restored", range(600, 700), DATA[600:700])
    assert past > t1
    other.__exit__(None, None, None)
    client = app(make_client, tmp_path, "a")
    info = client.get("/v1/collections/restored").json()
    assert info["index_state"]["loaded_from"] == "postgres" and info["count"] == 200
    assert set(top1(client, "restored", DATA[500:503], consistency="strong")[0]).isdisjoint({500, 501, 502})
    assert top1(client, "restored", DATA[600:700], consistency="strong")[0] == list(range(600, 700))
    assert_in_step(client, "restored", processes=1)


def test_a_snapshot_whose_rows_do_not_match_its_digest_is_rebuilt(make_client, tmp_path):
    client = app(make_client, tmp_path, "a")
    create(client, "tampered")
    upsert(client, "tampered", range(200), DATA[:200])
    cid = client.app.state.switchyard.vectors.catalog["tampered"].id
    client.__exit__(None, None, None)
    path = tmp_path / "a" / "vectors" / f"collection-{cid}.faiss.snapshot"
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    vectors = np.load(io.BytesIO(members["vectors.npy"]))
    vectors[5] = DATA[2500]  # point 5 now has another vector: a stale or damaged snapshot
    buffer = io.BytesIO()
    np.save(buffer, vectors)
    members["vectors.npy"] = buffer.getvalue()
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    client = app(make_client, tmp_path, "a")
    assert client.get("/v1/collections/tampered").json()["index_state"]["loaded_from"] == "postgres"
    assert top1(client, "tampered", DATA[:200])[0] == list(range(200))
    assert_in_step(client, "tampered", processes=1)


# -- consistency levels ----------------------------------------------------------------------------------
def test_consistency_levels_are_checked_and_reported(make_client, tmp_path):
    client = app(make_client, tmp_path, "a")
    create(client, "levels", metric="cosine")
    seq = upsert(client, "levels", range(50), DATA[:50])
    for level in ("strong", "bounded", "eventually"):
        _, _, body = top1(client, "levels", DATA[:2], consistency=level)
        assert body["consistency"] == level and body["watermark"] >= seq
    _, _, body = top1(client, "levels", DATA[:2], consistency="session", seq=seq)
    assert body["watermark"] >= seq
    body = client.post("/v1/collections/levels/search", json={"vector": DATA[0].tolist(), "engine": "pgvector"}).json()
    assert body["watermark"] is None and body["consistency"] == "bounded"
    search = "/v1/collections/levels/search"
    assert_problem(client.post(search, json={"vector": DATA[0].tolist(), "consistency": "linearizable"}),
                   422, "validation-error", "consistency")
    assert_problem(client.post(search, json={"vector": DATA[0].tolist(), "consistency": "session"}),
                   422, "validation-error", "seq")
    assert_problem(client.post(search, json={"vector": DATA[0].tolist(), "consistency": "session", "seq": -1}),
                   422, "validation-error", "seq")
    assert_in_step(client, "levels", processes=1)  # cosine: the digest is over unit vectors on both sides


def test_a_level_not_reached_in_time_falls_back_or_answers_503(make_client, tmp_path, monkeypatch):
    client = app(make_client, tmp_path, "a", consistency_timeout_ms=200)
    create(client, "slow")
    upsert(client, "slow", range(10), DATA[:10])
    original = CollectionStore.read_changes

    async def stuck(self, c, since):
        await asyncio.sleep(1.0)
        return await original(self, c, since)

    monkeypatch.setattr(CollectionStore, "read_changes", stuck)
    body = {"vector": DATA[3].tolist(), "k": 1, "consistency": "strong"}
    auto = client.post("/v1/collections/slow/search", json=body).json()
    assert (auto["engine"] == "pgvector" and auto["ids"] == [3]
            and "could not reach consistency 'strong'" in auto["fallback"])
    r = client.post("/v1/collections/slow/search", json={**body, "engine": "cpu"})
    assert_problem(r, 503, "unavailable", "consistency")
    assert r.headers["retry-after"] == "1"
    assert client.post("/v1/collections/slow/search", json={**body, "consistency": "eventually",
                                                             "engine": "cpu"}).json()["ids"] == [3]


def test_the_listener_comes_back_after_its_connection_is_killed(make_client, tmp_path, database_url):
    a = app(make_client, tmp_path, "a")
    b = app(make_client, tmp_path, "b", replication_poll_ms=60_000)  # only notifications can bring changes in
    create(a, "heard")
    follower = b.app.state.switchyard.vectors.follower

    async def kill_listener() -> int:
        conn = await asyncpg.connect(database_url)
        killed = await conn.fetchval("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                     "WHERE application_name = $1", follower.application_name[:63])
        await conn.close()
        return killed

    eventually(lambda: follower.listening and top1(b, "heard", DATA[:1], consistency="eventually"))
    assert run(kill_listener()) == 1
    eventually(lambda: follower.reconnects >= 1 and follower.listening)
    upsert(a, "heard", [42], DATA[[42]])
    eventually(lambda: top1(b, "heard", DATA[[42]], consistency="eventually")[0] == [42], timeout_s=3)


def test_the_follower_stops_even_when_cancelled_as_it_is_poked():
    """A poke (a reconnect asking for a poll) and the stop in the same turn of the event loop: Python 3.11's
    asyncio.wait_for returned the poke and dropped the cancellation, and the poll loop ran for ever."""
    from indexes.follower import Follower

    class Store:
        async def heads(self) -> dict:
            return {}

    class Handler:
        def on_heads(self, heads, read_at) -> None:
            pass

    async def scenario() -> None:
        follower = Follower(None, Store(), Handler(), process="t", poll_s=30)
        await follower.start()
        await asyncio.sleep(0.05)  # the poll loop now waits for its next turn
        follower.poll_now()
        async with asyncio.timeout(5):
            await follower.stop()

    run(scenario())


def test_a_process_does_not_read_back_its_own_writes(make_client, tmp_path, monkeypatch):
    """Its own commit's notification arrives while the write is being applied from the request's data: no
    catch-up read follows each write (it did: one query and one apply per write). Another process's commits are
    still read at once."""
    client = app(make_client, tmp_path, "a")
    create(client, "own")
    upsert(client, "own", range(10), DATA[:10])
    reads = []
    real = CollectionStore.read_changes

    async def counting(self, c, since):
        reads.append(since)
        return await real(self, c, since)

    monkeypatch.setattr(CollectionStore, "read_changes", counting)
    for i in range(10, 40):
        upsert(client, "own", [i], DATA[i:i + 1])
    time.sleep(0.3)  # notifications delivered, any catch-up they would start started
    assert len(reads) <= 3, reads  # polls may still read; per-write read-backs would be 30
    other = app(make_client, tmp_path, "b")
    upsert(other, "own", [40], DATA[40:41])
    deadline = time.monotonic() + 5  # the notification brings it, with no search asking for freshness
    while top1(client, "own", DATA[40:41], consistency="eventually")[0] != [40]:
        assert time.monotonic() < deadline, "another process's write never arrived"
        time.sleep(0.02)
