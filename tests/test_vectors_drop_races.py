"""Deleting a collection while other work on it runs: the pgvector index's background build (CREATE INDEX
CONCURRENTLY), a recall reading its rows, a transaction PostgreSQL picks as a deadlock's victim, a replica catching
up. The races are held at a known point by a transaction of the test's own on the collection's table (waits are
seen in pg_locks and pg_stat_progress_create_index), not left to timing. The DELETE answers 204 (or a clean 503),
the work on the deleted collection ends quietly or answers 404, never a 500."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import asyncpg
import pytest

from helpers import assert_problem, wait_job, wait_ready
from vector_data import b64, clustered

WAITING_FOR_TABLE = ("SELECT count(*) FROM pg_locks WHERE relation = to_regclass($1) AND NOT granted "
                     "AND mode = $2")


class Holder:
    """A connection of the test's own, on the app's event loop (the TestClient's portal), holding a transaction."""

    def __init__(self, client, dsn: str) -> None:
        self.portal = client.portal
        self.conn = self.portal.call(asyncpg.connect, dsn)

    def sql(self, query: str, *args: Any) -> Any:
        return self.portal.call(self.conn.fetchval, query, *args)

    def do(self, statement: str) -> None:
        self.portal.call(self.conn.execute, statement)

    def until(self, query: str, *args: Any, timeout_s: float = 30) -> None:
        """Poll until `query` answers something true."""
        deadline = time.monotonic() + timeout_s
        while not self.sql(query, *args):
            assert time.monotonic() < deadline, f"never true: {query} {args}"
            time.sleep(0.01)

    def close(self) -> None:
        self.portal.call(self.conn.close)


@pytest.fixture
def served(make_client, database_url):
    """A ready service answering server errors (not raising them), and a Holder on its database."""
    client = make_client(raise_server_exceptions=False)
    wait_ready(client)
    holder = Holder(client, database_url)
    yield client, holder
    holder.close()


def _loud(caplog) -> list[str]:
    """What the vector domain and the error handlers logged above INFO."""
    return [r.getMessage() for r in caplog.records
            if r.levelno > logging.INFO and r.name in ("switchyard.vectors", "switchyard.errors")]


def _collection(client, name: str, n: int) -> str:
    """A collection of `n` 8-d points; its table."""
    assert client.post("/v1/collections", json={"name": name, "dim": 8}).status_code == 201
    put = client.put(f"/v1/collections/{name}/points",
                     json={"ids": list(range(n)), "vectors_b64": b64(clustered(n, 8, seed=5))})
    assert put.status_code == 200, put.text
    return client.portal.call(client.app.state.switchyard.vectors.collection, name).table


def test_a_delete_during_the_concurrent_pgvector_build_succeeds_and_the_build_ends_quietly(served, caplog):
    """The background CREATE INDEX CONCURRENTLY waits for every transaction older than it, the drop's too while the
    drop waits for the table's lock, which the build holds: PostgreSQL broke that deadlock by failing the DELETE
    (500). The drop now cancels the build first; the build, failing, waits for the drop and says so at INFO.
    300 points: a build that quick reaches its wait before PostgreSQL looks for the deadlock, as a drop's did."""
    caplog.set_level(logging.INFO)
    client, holder = served
    vectors = client.app.state.switchyard.vectors
    table = _collection(client, "e", 300)
    holder.do("BEGIN")
    holder.do(f"LOCK TABLE {table} IN ROW EXCLUSIVE MODE")  # a writer: the concurrent build waits for it
    job = wait_job(client, client.post("/v1/collections/e/build").headers["location"])
    assert job["state"] == "succeeded" and job["result"]["pgvector_index"] == "building", job
    holder.until("SELECT count(*) FROM pg_stat_progress_create_index WHERE relid = to_regclass($1)", table)
    with ThreadPoolExecutor(1) as pool:
        deleting = pool.submit(lambda: client.delete("/v1/collections/e"))
        holder.until(WAITING_FOR_TABLE, table, "AccessExclusiveLock")  # the drop waits for the table
        holder.do("COMMIT")  # the build, if still running, goes on to wait for the drop
        deleted = deleting.result(timeout=60)
    assert deleted.status_code == 204, deleted.text
    deadline = time.monotonic() + 30
    while "e" in vectors.fallback_builds:
        assert time.monotonic() < deadline, "the background build never ended"
        time.sleep(0.02)
    assert_problem(client.get("/v1/collections/e"), 404, "not-found")
    assert _loud(caplog) == []
    assert any("was deleted while its pgvector index was being built" in r.getMessage() for r in caplog.records)


def test_a_recall_whose_table_is_dropped_meanwhile_is_404(served):
    """Recall read the rows of a collection being deleted (its replica already forgotten): when the drop committed,
    its COPY failed on the missing table, a 500. Now it is the collection not found, as for search."""
    client, holder = served
    table = _collection(client, "d", 200)
    holder.do("BEGIN")
    holder.do(f"LOCK TABLE {table} IN ACCESS SHARE MODE")  # the drop waits for it; reads do not
    with ThreadPoolExecutor(2) as pool:
        deleting = pool.submit(lambda: client.delete("/v1/collections/d"))
        holder.until(WAITING_FOR_TABLE, table, "AccessExclusiveLock")
        recalling = pool.submit(lambda: client.post("/v1/collections/d/recall", json={"sample": 10, "k": 5}))
        holder.until(WAITING_FOR_TABLE, table, "AccessShareLock")  # its read queued behind the drop
        holder.do("COMMIT")
        deleted, recalled = deleting.result(timeout=60), recalling.result(timeout=60)
    assert deleted.status_code == 204, deleted.text
    body = assert_problem(recalled, 404, "not-found", "collection")
    assert body["detail"] == "no collection named 'd'"


def _deadlocked_delete(client, holder: Holder, name: str):
    """A DELETE PostgreSQL fails as a deadlock's victim: the test's transaction holds the table the drop waits
    for, then waits for the collection's row the drop holds. The DELETE's answer, once the test's transaction
    ended."""
    table = _collection(client, name, 20)
    collection_id = int(table.removeprefix("vectors_"))
    holder.do("BEGIN")
    holder.do(f"LOCK TABLE {table} IN ACCESS SHARE MODE")
    with ThreadPoolExecutor(1) as pool:
        deleting = pool.submit(lambda: client.delete(f"/v1/collections/{name}"))
        holder.until(WAITING_FOR_TABLE, table, "AccessExclusiveLock")
        # Waits for the drop (its row lock) while the drop waits for this transaction: the drop, waiting first,
        # sees the cycle first and fails.
        assert holder.sql("SELECT 1 FROM vector_collections WHERE id = $1 FOR SHARE", collection_id) == 1
        holder.do("COMMIT")
        return deleting.result(timeout=60)


def test_a_delete_that_deadlocks_is_tried_again(served):
    """A drop that PostgreSQL fails to break a deadlock (as one with an index build that started after the drop
    cancelled those running would be) is tried again after a pause, and succeeds."""
    client, holder = served
    assert _deadlocked_delete(client, holder, "victim").status_code == 204
    assert_problem(client.get("/v1/collections/victim"), 404, "not-found")


def test_a_delete_that_keeps_deadlocking_is_a_clean_503(served, monkeypatch):
    """Out of tries: 503 with Retry-After, and nothing deleted, never a 500."""
    import indexes.store

    monkeypatch.setattr(indexes.store, "DROP_TRIES", 1)
    client, holder = served
    answer = _deadlocked_delete(client, holder, "stuck")
    assert_problem(answer, 503, "unavailable", "collection")
    assert answer.headers["retry-after"] == "1"
    assert client.get("/v1/collections/stuck").status_code == 200  # nothing was deleted
    assert client.delete("/v1/collections/stuck").status_code == 204


def test_a_replica_whose_collection_was_dropped_stops_catching_up_quietly(served, database_url, caplog):
    """Another process drops the collection; a wake of the replica here (a write in flight ending, a failed apply)
    found the table gone and retried its catch-up for ever, warning each time, even after the replica stopped."""
    from indexes.store import CollectionStore

    caplog.set_level(logging.INFO)
    client, _ = served
    _collection(client, "gone", 20)
    vectors = client.app.state.switchyard.vectors
    r = vectors.resident["gone"]

    async def drop_elsewhere_then_wake() -> None:
        pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
        try:
            await CollectionStore(pool).drop("gone")
        finally:
            await pool.close()
        r.wake(time.monotonic())  # before or after this process heard of the drop
        for _ in range(200):  # until it has, and stopped the replica
            if "gone" not in vectors.resident and (r._pump is None or r._pump.done()):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        r.wake(time.monotonic())  # as a write in flight during the drop does when it ends
        await asyncio.sleep(0.3)
        assert "gone" not in vectors.resident and (r._pump is None or r._pump.done())

    client.portal.call(drop_elsewhere_then_wake)
    assert _loud(caplog) == []


def test_a_second_pgvector_build_waits_for_the_one_running_instead_of_dropping_it(served, caplog):
    """Two builds of one collection in a row each started the pgvector index's background build; the second took
    the first's index, invalid while CREATE INDEX CONCURRENTLY runs, for one a failed build left, and dropped it:
    a deadlock (ERROR in the log). Now a build waits while another backend builds that index, then finds it."""
    from indexes import pgvector_search

    caplog.set_level(logging.INFO)
    client, holder = served
    vectors = client.app.state.switchyard.vectors
    table = _collection(client, "twice", 300)
    c = client.portal.call(vectors.collection, "twice")
    holder.do("BEGIN")
    holder.do(f"LOCK TABLE {table} IN ROW EXCLUSIVE MODE")  # a writer: the concurrent build waits for it
    job = wait_job(client, client.post("/v1/collections/twice/build").headers["location"])
    assert job["result"]["pgvector_index"] == "building", job
    holder.until("SELECT count(*) FROM pg_stat_progress_create_index WHERE relid = to_regclass($1)", table)
    assert holder.sql(pgvector_search.INDEX_VALID, f"{table}_ann") is False  # the first build's, under way
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(client.portal.call, pgvector_search.build_index, vectors.pool, c, 300)
        time.sleep(1.5)  # past PostgreSQL's deadlock_timeout (1 s): a DROP INDEX would have deadlocked by now
        assert not second.done()  # waiting for the first
        holder.do("COMMIT")
        assert second.result(timeout=60) == "hnsw"
    deadline = time.monotonic() + 30
    while "twice" in vectors.fallback_builds:
        assert time.monotonic() < deadline, "the background build never ended"
        time.sleep(0.02)
    assert holder.sql(pgvector_search.INDEX_VALID, f"{table}_ann") is True
    assert _loud(caplog) == []
