"""Sharded vector collections without Ray: the id split, the exact merge, and an ingress fanning out to shard hosts
that run in this process (the Ray layer only places the same hosts elsewhere: tests/test_ray_cluster.py)."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np
import pytest

from conftest import run
from indexes.errors import EngineUnavailable, InvalidInput, ShardUnavailable
from indexes.manager import CollectionManager
from indexes.resident import Changes, SearchResult
from indexes.shards import Shard, merge_results, shard_of
from indexes.vectors import Points, encode_payloads
from service.admission.control import Admission
from service.cluster.fanout import ShardSet
from service.cluster.shard_host import ShardHost
from service.cluster.sharded import ShardedCollections
from service.database.migrate import apply_migrations
from service.database.postgres import open_pool
from service.settings import Settings


def test_the_shard_of_an_id_is_stable_and_even():
    ids = np.arange(100_000, dtype=np.int64)
    shards = shard_of(ids, 4)
    assert shards.min() == 0 and shards.max() == 3
    counts = np.bincount(shards, minlength=4)
    assert counts.min() > 0.24 * len(ids)  # consecutive ids spread out
    # Fixed values: the split must not change between versions, or snapshots would hold the wrong rows.
    assert shard_of(np.array([0, 1, 2, 3, -5, 2**62], dtype=np.int64), 7).tolist() == [2, 2, 4, 2, 5, 4]


def test_a_shard_keeps_only_its_own_rows_of_a_change():
    ids = np.arange(20, dtype=np.int64)
    vectors = np.arange(40, dtype=np.float32).reshape(20, 2)
    changes = Changes(3, 9, np.array([100, 101, 102, 103], dtype=np.int64), ids, vectors, [(9, 0.0)],
                      payloads=[{"i": int(i)} for i in ids])
    parts = [Shard(s, 3).take(changes) for s in range(3)]
    assert sorted(np.concatenate([p.ids for p in parts]).tolist()) == ids.tolist()
    assert sorted(np.concatenate([p.deleted for p in parts]).tolist()) == [100, 101, 102, 103]
    for s, p in enumerate(parts):
        assert (p.since, p.head, p.commits) == (3, 9, [(9, 0.0)])
        assert (shard_of(p.ids, 3) == s).all()
        assert [x["i"] for x in p.payloads] == p.ids.tolist()
        assert np.array_equal(p.vectors, vectors[p.ids])
    with pytest.raises(ValueError):
        Shard(3, 3)


def test_merging_takes_the_k_nearest_of_the_union_and_the_lowest_watermark():
    a = SearchResult([[1, 5, 9], [2]], [[0.1, 0.5, 0.9], [0.2]], watermark=7)
    b = SearchResult([[4, 6], [3, 8]], [[0.4, 0.5], [0.1, 0.3]], watermark=5)
    merged = merge_results([a, b], 3)
    assert merged.ids == [[1, 4, 5], [3, 2, 8]]  # 0.5 tie: the lower id first
    assert merged.distances == [[0.1, 0.4, 0.5], [0.1, 0.2, 0.3]]
    assert merged.watermark == 5
    plans = merge_results([SearchResult([[1]], [[0.0]], 1, {"plan": "exact", "matched_rows": 3, "live_rows": 10}),
                           SearchResult([[2]], [[1.0]], 1, {"plan": "exact", "matched_rows": 1, "live_rows": 10})], 1)
    assert plans.plan["matched_rows"] == 4 and plans.plan["selectivity"] == 0.2 and plans.plan["plan"] == "exact"


# -- an ingress and shard hosts in this process ------------------------------------------------------------------
class Down(Exception):
    """A replica the test switched off (a dead actor, on Ray)."""


def local_shards(hosts: list[list[ShardHost]], off: set[tuple[int, int]], calls: list[str]) -> ShardSet:
    """The hosts behind a ShardSet, each switchable off (its calls raise, searches on its direct channel too);
    call before the hosts start, so their direct channels serve the guarded search."""
    for s, shard in enumerate(hosts):
        for r, host in enumerate(shard):
            search = host.search

            async def guarded(*args: Any, _at: tuple[int, int] = (s, r), _search: Any = search) -> Any:
                calls.append("search")
                if _at in off:
                    raise Down(f"replica {_at} is off")
                return await _search(*args)

            host.search = guarded  # type: ignore[method-assign]

    where = {id(h): (s, r) for s, shard in enumerate(hosts) for r, h in enumerate(shard)}

    async def call(host: ShardHost, method: str, args: tuple) -> Any:
        if method != "search" and where[id(host)] in off:
            raise Down(f"replica {where[id(host)]} is off")
        out = getattr(host, method)(*args)
        return await out if inspect.isawaitable(out) else out

    return ShardSet(hosts, call, call_timeout_s=10)


async def _migrated(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await apply_migrations(conn)
    finally:
        await conn.close()


async def _scenario(dsn: str, data_dir: Path) -> None:
    await _migrated(dsn)
    settings = Settings(database_url=dsn, data_dir=data_dir)
    hosts = [[ShardHost(dsn, str(data_dir), s, 2, r) for r in range(2)] for s in range(2)]
    off: set[tuple[int, int]] = set()
    calls: list[str] = []
    shards = local_shards(hosts, off, calls)
    for shard in hosts:
        for h in shard:
            await h.start()
    shards.kind = hosts[0][0].kind
    pool = await open_pool(dsn, min_size=1, max_size=4, command_timeout=60)
    ingress = ShardedCollections(pool, data_dir / "ingress", shards, guard=Admission(settings))
    single_pool = await open_pool(dsn, min_size=1, max_size=4, command_timeout=60)
    single = CollectionManager(single_pool, data_dir / "single", dsn=dsn, guard=Admission(settings))
    from indexes.faiss_index import FaissBackend
    single.attach("cpu", FaissBackend())
    await ingress.start()
    await single.start()
    try:
        rng = np.random.default_rng(5)
        n, dim = 600, 8
        await ingress.create("sharded", dim, "l2", "brute_force", None, {"type": "none"})
        vectors = rng.standard_normal((n, dim)).astype(np.float32)
        ids = np.arange(1, n + 1, dtype=np.int64)
        payloads = [{"colour": ["red", "blue", "green"][i % 3], "n": i} for i in range(n)]
        seq = 0
        for start in range(0, n, 150):
            part = slice(start, start + 150)
            points = Points(ids[part], vectors[part], encode_payloads(payloads[part], 150))
            seq = await ingress.upsert("sharded", points)
        gone = ids[::7]
        _, seq = await ingress.delete("sharded", gone)
        alive = ~np.isin(ids, gone)
        queries = rng.standard_normal((5, dim)).astype(np.float32)
        truth = np.argsort(((vectors[alive][None] - queries[:, None]) ** 2).sum(-1), axis=1)[:, :10]
        answer = await ingress.search("sharded", queries, 10, "cpu", consistency="session", seq=seq)
        assert answer.engine == "faiss"
        assert answer.result.ids == ids[alive][truth].tolist()
        await single.sync_catalog_now()
        await asyncio.sleep(0.5)
        one = await single.search("sharded", queries, 10, "cpu", consistency="session", seq=seq)
        assert one.result.ids == answer.result.ids  # id for id
        assert np.allclose(one.result.distances, answer.result.distances, atol=1e-5)
        for s, shard in enumerate(hosts):  # each host holds its shard's live rows, no others
            for h in shard:
                held = h.vectors.resident["sharded"].index
                live_ids, _ = held.live()
                assert sorted(live_ids.tolist()) == sorted(ids[alive & (shard_of(ids, 2) == s)].tolist())
        # Concurrent single-query searches with the same options: one answer each, fewer fan-outs than requests.
        before = calls.count("search")
        singles = await asyncio.gather(*(ingress.search("sharded", q[None], 10, "cpu", single=True,
                                                        consistency="session", seq=seq) for q in queries))
        assert [a.result.ids[0] for a in singles] == answer.result.ids
        assert calls.count("search") - before < 2 * len(queries)  # 2 shards: one call each per fan-out
        # A filter: the same rows as the oracle, and a plan summed over the shards.
        red = await ingress.search("sharded", queries[:1], 10, "cpu", payload_filter={"colour": "red"},
                                   consistency="session", seq=seq)
        is_red = np.array([p["colour"] == "red" for p in payloads]) & alive
        exact = np.argsort(((vectors[is_red] - queries[0]) ** 2).sum(-1))[:10]
        assert red.result.ids == [ids[is_red][exact].tolist()]
        assert red.result.plan["matched_rows"] == int(is_red.sum())
        # A request's own error comes back as it is, not as a shard down (every replica would raise it).
        with pytest.raises(InvalidInput):
            await ingress.search("sharded", queries, 10, "cpu", params={"n_probes": 4})
        # One replica of a shard off: the other answers. Both off: 503 named, or pgvector under auto.
        off.add((0, 0))
        again = await ingress.search("sharded", queries, 10, "cpu", consistency="session", seq=seq)
        assert again.result.ids == answer.result.ids
        off.add((0, 1))
        with pytest.raises(ShardUnavailable):
            await ingress.search("sharded", queries, 10, "cpu")
        fallback = await ingress.search("sharded", queries, 10, "auto")
        assert fallback.engine == "pgvector" and "shard 0" in fallback.fallback
        assert fallback.result.ids == answer.result.ids  # pgvector with no index is exact too
        off.clear()
        described = await ingress.describe("sharded")
        assert [len(s["replicas"]) for s in described["shards"]] == [2, 2]
        # searches went over the replicas' direct channels, not the placing layer's calls
        assert all(r["data"] for s in described["shards"] for r in s["replicas"]) and shards._clients
        assert all(r["index_state"]["watermark"] >= seq for s in described["shards"] for r in s["replicas"])
    finally:
        await single.stop()
        await ingress.stop()
        for shard in hosts:
            for h in shard:
                await h.stop()
        await pool.close()
        await single_pool.close()


def test_an_ingress_over_two_shards_of_two_replicas_answers_as_one_process(database_url, tmp_path):
    run(_scenario(database_url, tmp_path / "data"))


async def _a_new_collection_loads_on_its_own(dsn: str, data_dir: Path) -> None:
    await _migrated(dsn)
    pool = await open_pool(dsn, min_size=1, max_size=4, command_timeout=60)
    writer = CollectionManager(pool, data_dir / "writer", dsn=dsn, guard=Admission(Settings(data_dir=data_dir)))
    from indexes.faiss_index import FaissBackend
    writer.attach("cpu", FaissBackend())
    await writer.start()
    host = ShardHost(dsn, str(data_dir), 0, 1, 0, {"shard_call_timeout_s": 0.5})
    rng = np.random.default_rng(11)
    ids = np.arange(1, 51, dtype=np.int64)

    async def collection(name: str) -> tuple[np.ndarray, int]:
        await writer.create(name, 4, "l2", "brute_force", None, {"type": "none"})
        vectors = rng.standard_normal((50, 4)).astype(np.float32)
        return vectors, await writer.upsert(name, Points(ids, vectors, encode_payloads([{}] * 50, 50)))

    try:
        older, _ = await collection("older")
        await host.start()
        while not host.ready():  # what it held at its start is loaded
            await asyncio.sleep(0.05)
        assert host.vectors is not None
        gate, load = asyncio.Event(), host.vectors._load

        async def held(r: Any) -> None:  # the new collection's load waits for the gate
            if r.collection.name == "newer":
                await gate.wait()
            await load(r)

        host.vectors._load = held  # type: ignore[method-assign]
        newer, seq = await collection("newer")
        while "newer" not in host.vectors.resident:
            await host.vectors.sync_catalog_now()
        # Loading the new collection, the host stays ready, and the older one is served.
        assert host.ready()
        old, _ = await host.search("older", older[3:4], 1, None, None, "strong", None, None)
        assert old.ids == [[4]]
        # A search of the one loading waits for its load, as long as the ingress waits for a call (0.5 s) ...
        with pytest.raises(EngineUnavailable, match="still loading"):
            await host.search("newer", newer[7:8], 1, None, None, "strong", None, None)
        # ... and is answered once the load is over.
        waiting = asyncio.ensure_future(host.search("newer", newer[7:8], 1, None, None, "session", seq, None))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        gate.set()
        new, _ = await waiting
        assert new.ids == [[8]]
    finally:
        await host.stop()
        await writer.stop()
        await pool.close()


def test_a_host_serves_while_a_new_collection_loads_and_searches_of_it_wait_for_the_load(database_url, tmp_path):
    run(_a_new_collection_loads_on_its_own(database_url, tmp_path / "data"))
