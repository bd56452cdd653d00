"""The vector domain's facade: collections in Postgres, their resident replicas, routing between engines.

Write path: validate -> Postgres transaction (serialised per collection; it takes the change seqs and records
the commit) -> this process's replica applies the commit (indexes/replica.py) -> ack with the seq.
Every process follows the change log (indexes/follower.py: LISTEN/NOTIFY plus a poll), so each resident replica
is PostgreSQL's state at its watermark, whichever process took the write.
Read path: the consistency level asked for is reached (or `auto` falls back to pgvector) -> pick an engine
(gpu -> cpu -> pgvector for `auto`) -> search -> the response says which engine served, at which watermark,
and why it fell back, if it did.
Start-up: each collection's snapshot is validated (content digest, its commit still in PostgreSQL's log) and
caught up from the log; without a usable snapshot the replica is read whole from Postgres.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import asyncpg
import numpy as np

from . import filters, pgvector_search, reports, snapshots
from .ann import INDEX_TYPES, check_build_shape, check_params, resolve_type, search_params
from .batching import MicroBatcher
from .build_process import DetachedBuilder
from .distance import METRICS, exact_search, from_engine, prepare
from .errors import CollectionEmpty, CollectionNotFound, EngineFailed, EngineUnavailable, InvalidInput, NotCaughtUp
from .follower import Follower
from .group_commit import GroupCommit
from .planner import CALIBRATION_QUERIES
from .replica import Applied, Replica, check_level
from .resident import Changes, IndexBackend, PendingBuild, RebuildPolicy, ResidentCollection, SearchResult
from .shards import Shard
from .store import SMALL_WRITE_ROWS, Collection, CollectionStore, Commit
from .tasks import stop_tasks
from .vectors import MAX_K, Points

log = logging.getLogger("switchyard.vectors")

ENGINE_KIND = {"gpu": "cuvs", "cpu": "faiss"}
SNAPSHOT_QUIET_S = 2.0  # see _snapshot_soon
Progress = Callable[[int, int | None, str], None]
T = TypeVar("T")


@dataclass(frozen=True)
class Consistency:
    """How searches meet their consistency level (see indexes/replica.py)."""

    default: str = "bounded"
    bound_s: float = 1.0  # bounded staleness: resident state at most this old
    timeout_s: float = 2.0  # how long a search may wait to reach its level before falling back / 503
    poll_s: float = 0.2  # the followers' poll of every collection's head


@dataclass
class SearchAnswer:
    result: SearchResult
    engine: str
    took_ms: float
    fallback: str | None = None


def build_detached(index: ResidentCollection, builder: DetachedBuilder, scratch: Path,
                   say: Callable[[str], None] | None) -> PendingBuild:
    """A rebuild's first half for an engine whose builds may run in a child process (cuVS): rows chosen, and a
    large index built there, without a call into the engine, so the engine's one thread serves searches meanwhile.
    build_and_calibrate then installs it on that thread."""
    pending = index.plan_build(hold_out=CALIBRATION_QUERIES)
    if pending.n_indexed and builder.wants(pending.n_indexed, index.dim):
        if say:
            say(f"building {pending.config.index_type} over {pending.n_indexed} vectors in a build process")
        pending.data = builder.build(pending.config, pending.vectors[:pending.n_indexed], scratch)
    return pending


def check_target(recall_target: float | None, params: dict[str, Any] | None) -> None:
    if recall_target is None:
        return
    if params:
        raise InvalidInput("give either search params or a recall_target, not both", field="recall_target")
    if not 0 < recall_target <= 1:
        raise InvalidInput("must be above 0 and at most 1", field="recall_target")


def build_and_calibrate(index: ResidentCollection, say: Callable[[str], None] | None,
                        pending: PendingBuild | None = None) -> None:
    """Rebuild holding a sample out of the index (or install `pending`, a rebuild whose index was built
    elsewhere), measure the new index's recall over its parameter sweep with that sample as queries (for recall
    targets), then add the sample to the index."""
    if pending is None:
        index.rebuild(say, hold_out=CALIBRATION_QUERIES)
    else:
        index.install(pending, say)
    try:
        if index.held_out is not None:
            if say:
                say("calibrating recall over the search-parameter sweep")
            index.calibrate()
    finally:
        index.absorb()


class CollectionManager:
    def __init__(self, pool: asyncpg.Pool, data_dir: Path, *, dsn: str | None = None, max_batch: int = 64,
                 batch_window_s: float = 0.0, inline_search_s: float = 0.0, inline_turn_s: float = 0.003,
                 observe: Callable[[str, str, float, bool], None] | None = None,
                 consistency: Consistency | None = None, policy: RebuildPolicy | None = None,
                 on_applied: Applied | None = None, guard: Any = None, shard: Shard | None = None) -> None:
        self.store = CollectionStore(pool)
        self.pool = pool
        self.data_dir = data_dir
        self.snapshots = snapshots.Snapshots(data_dir / "vectors", self.store)
        self.backends: dict[str, IndexBackend] = {}  # "gpu"/"cpu" -> backend that keeps indexes resident
        self.executors: dict[str, ThreadPoolExecutor] = {}  # searches and change applies
        self.build_executors: dict[str, ThreadPoolExecutor] = {}  # rebuilds
        self.resident: dict[str, Replica] = {}
        self.write_groups: dict[str, GroupCommit] = {}  # concurrent small upserts, one transaction each group
        self.fallback_builds: set[str] = set()  # collections whose pgvector index is being built in the background
        self._creating: set[str] = set()  # collections this process is creating: it registers their replicas
        self.by_id: dict[int, Replica] = {}
        self.max_batch, self.batch_window_s, self.inline_search_s = max_batch, batch_window_s, inline_search_s
        self.inline_turn_s = inline_turn_s
        self.batchers: dict[str, MicroBatcher] = {}
        self.observe = observe or (lambda engine, op, seconds, ok: None)
        # Admission control (service/admission/control.py): slot(engine) around each engine call, cooling(engine) to
        # route around an engine that keeps failing, failed()/succeeded() to tell it how calls went.
        self.guard = guard
        self.consistency = consistency or Consistency()
        self.policy = policy or RebuildPolicy()
        self.on_applied = on_applied or (lambda collection_id, seq, at: None)
        self.shard = shard  # this process's replicas keep only this shard's ids (indexes/shards.py)
        self.loading: asyncio.Task | None = None
        self.catalog: dict[str, Collection] = {}  # name -> definition; definitions never change
        self.process = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.follower = Follower(dsn, self.store, self, process=self.process, poll_s=self.consistency.poll_s)
        self._syncing: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    # -- engines ---------------------------------------------------------------------------------------
    def attach(self, kind: str, backend: IndexBackend) -> None:
        """Make a backend hold resident indexes. cuVS calls must come from one thread (NVIDIA/cuvs #2041), so on
        the GPU rebuilds share that thread, except what a backend's build process (build_process.py) does; on the
        CPU they have their own, and searches keep two."""
        self.backends[kind] = backend
        self.executors[kind] = ThreadPoolExecutor(max_workers=1 if kind == "gpu" else 2,
                                                  thread_name_prefix=f"vectors-{kind}")
        # A build process (build_process.py) frees the GPU thread during builds; without one they share it.
        shares = kind == "gpu" and getattr(backend, "builder", None) is None
        self.build_executors[kind] = self.executors[kind] if shares else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"vectors-{kind}-build")
        # Lone cheap searches may run on the event loop (see batching.py), on the CPU only: cuVS calls must stay
        # on their one thread.
        self.batchers[kind] = MicroBatcher(self._run_batch, self.executors[kind], max_batch=self.max_batch,
                                           window_s=self.batch_window_s,
                                           inline_below_s=self.inline_search_s if kind == "cpu" else 0.0,
                                           can_inline=self._uncontended, turn_budget_s=self.inline_turn_s)

    @property
    def resident_kind(self) -> str | None:
        """Where new resident indexes live: the GPU when there is one, else the CPU."""
        return "gpu" if "gpu" in self.backends else "cpu" if "cpu" in self.backends else None

    @property
    def ready(self) -> bool:
        return (self.loading is not None and self.loading.done()
                and all(r.loaded or r.error for r in self.resident.values()))

    async def start(self) -> None:
        await self.follower.start()  # listening before loading: nothing committed meanwhile is missed
        self.loading = asyncio.create_task(self._load_all())

    async def stop(self) -> None:
        await self.follower.stop()
        for backend in self.backends.values():  # a build still running in a child process is not waited for
            if (builder := getattr(backend, "builder", None)) is not None:
                builder.stop()
        await stop_tasks(self.loading, self._syncing, *self._background)
        for r in list(self.resident.values()):
            await r.stop()
        await self.save_snapshots()
        for executor in {*self.executors.values(), *self.build_executors.values()}:
            executor.shutdown(wait=True)

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Future:
        """A background task that is kept (not garbage-collected), cancelled at stop, and logged if it fails."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed", name, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    # -- collections -----------------------------------------------------------------------------------
    async def collection(self, name: str) -> Collection:
        """The collection's definition, from memory after the first lookup (no database round trip)."""
        c = self.catalog.get(name)
        if c is None:
            c = self.catalog[name] = await self.store.get(name)
        return c

    async def _with_collection(self, name: str, fn: Callable[[Collection], Awaitable[T]]) -> tuple[Collection, T]:
        """Run fn on the collection; if another process dropped (and perhaps re-created) it since this one cached
        its definition, forget the stale one and try once more with what PostgreSQL holds now."""
        c = await self.collection(name)
        try:
            return c, await fn(c)
        except asyncpg.UndefinedTableError:
            self._forget(name)
            c = await self.collection(name)
            return c, await fn(c)

    async def create(self, name: str, dim: int, metric: str, index_type: str, index_params: dict[str, Any] | None,
                     pgvector_index: dict[str, Any] | None) -> Collection:
        if metric not in METRICS:
            raise InvalidInput(f"must be one of {', '.join(METRICS)}", field="metric")
        if index_type not in INDEX_TYPES:
            raise InvalidInput(f"must be one of {', '.join(INDEX_TYPES)}", field="index.type")
        params = check_params("build", index_type, index_params, "index.params")
        check_build_shape(index_type, params, dim, "index.params")
        pg_index = pgvector_search.check_index(pgvector_index, dim)
        self._creating.add(name)  # its own catalog notification may arrive first: that sync leaves it to us
        try:
            c = await self.store.create(name, dim, metric, index_type, params, pg_index)
        finally:
            self._creating.discard(name)
        self.catalog[name] = c
        if self.resident_kind is not None and c.id not in self.by_id:
            r = self._new_replica(c)
            r.loaded, r.fresh_as_of = True, time.monotonic()  # nothing can have been written to it yet
            self._register(r)
        return c

    async def drop(self, name: str) -> None:
        c = await self.collection(name)
        self._forget(name)
        try:
            await self.store.drop(name)
        finally:
            self.snapshots.remove(c.id)

    def _register(self, r: Replica) -> None:
        self.catalog[r.collection.name] = r.collection
        self.resident[r.collection.name] = r
        self.by_id[r.collection.id] = r

    def _forget(self, name: str) -> None:
        """Drop this process's cached definition and replica of a collection (dropped here or elsewhere)."""
        self.write_groups.pop(name, None)
        self.catalog.pop(name, None)
        r = self.resident.pop(name, None)
        if r is not None:
            self.by_id.pop(r.collection.id, None)
            self._spawn(r.stop(), f"stopping the replica of {name}")

    @property
    def _shard_label(self) -> str | None:
        return str(self.shard) if self.shard is not None else None

    def _new_replica(self, c: Collection) -> Replica:
        kind = self.resident_kind
        assert kind is not None

        def new_index() -> ResidentCollection:
            return ResidentCollection(c.name, c.dim, c.metric, c.index_type, c.index_params, self.backends[kind],
                                      self.policy)

        async def run(fn: Callable[..., Any], *args: Any) -> Any:
            return await asyncio.get_running_loop().run_in_executor(self.executors[kind], fn, *args)

        async def read_changes(since: int) -> Changes:
            changes = await self.store.read_changes(c, since)
            return changes if self.shard is None else self.shard.take(changes)

        return Replica(c, new_index(), read_changes, run, new_index, self.on_applied)

    async def describe(self, name: str, verify: bool = False) -> dict[str, Any]:
        """The collection, its count, its replica here, and every process's replica (watermark, lag, digest)
        beside PostgreSQL's head (and its content digest when `verify`)."""
        async def described(c: Collection) -> dict[str, Any]:
            r = self.resident.get(name)
            engines = ["pgvector"]
            state: dict[str, Any] = {"resident": False}
            if r is not None:
                engines.insert(0, r.index.backend.name)
                state = r.state()
                if r.loaded:
                    state.update(await r.run(r.index.planner_report))
            state["pgvector_index"] = "building" if name in self.fallback_builds else await pgvector_search.has_index(
                self.pool, c)
            own = await reports.report(self.store, self.follower, c, self.by_id.get(c.id), self._shard_label)
            replication = await reports.gather(self.store, self.follower, c, own, verify)
            return {"collection": c, "count": await self.store.count(c), "engines": engines, "index_state": state,
                    "replication": replication}

        # Dropped meanwhile (here or by another process): the retry finds it gone (404) or re-created.
        return (await self._with_collection(name, described))[1]

    # -- replication -----------------------------------------------------------------------------------
    # FollowerHandler: called on the event loop by the follower.
    def on_change(self, collection_id: int, seq: int) -> None:
        r = self.by_id.get(collection_id)
        if r is None:
            self._sync_catalog()  # a collection this process has not heard of yet
        elif r.loaded:
            r.notified(seq)

    def on_catalog(self, collection_id: int) -> None:
        self._sync_catalog()

    def on_report(self, collection_id: int, request: str) -> None:
        async def answer() -> None:
            r = self.by_id.get(collection_id)
            c = r.collection if r is not None else next(
                (x for x in await self.store.list() if x.id == collection_id), None)
            if c is not None:
                own = await reports.report(self.store, self.follower, c, r, self._shard_label)
                await self.store.save_report(self.process, collection_id, request, own)

        self._spawn(answer(), "a replica report")

    def on_heads(self, heads: dict[int, tuple[str, int]], read_at: float) -> None:
        if self.resident_kind is not None and set(heads) != set(self.by_id):
            self._sync_catalog()
        for cid, (_, head) in heads.items():
            r = self.by_id.get(cid)
            if r is not None and r.loaded:
                r.note_head(head, read_at)

    def _sync_catalog(self) -> None:
        if self.resident_kind is None or self.loading is None or not self.loading.done():
            return  # the initial load reads the catalog itself
        if self._syncing is None or self._syncing.done():
            self._syncing = asyncio.ensure_future(self.sync_catalog_now())

    async def sync_catalog_now(self) -> None:
        """Take in collections created by other processes and drop those they dropped."""
        current = {c.id: c for c in await self.store.list()}
        for r in list(self.by_id.values()):
            if r.collection.id not in current:
                log.info("collection %s was dropped by another process", r.collection.name)
                self._forget(r.collection.name)
                self.snapshots.remove(r.collection.id)
        for cid, c in current.items():
            if cid not in self.by_id and c.name not in self._creating:
                stale = self.catalog.get(c.name)
                if stale is not None and stale.id != cid:
                    self._forget(c.name)
                r = self._new_replica(c)
                self._register(r)
                self._spawn(self._load_one(r), f"loading collection {c.name}")

    # -- writes ----------------------------------------------------------------------------------------
    async def upsert(self, name: str, points: Points) -> int:
        """Returns the change seq of the write; acknowledged data is committed in Postgres."""
        c = await self.collection(name)
        if points.vectors.shape[1] != c.dim:
            raise InvalidInput(f"vectors have dimension {points.vectors.shape[1]}, the collection has {c.dim}",
                               field="vectors")
        if len(points.ids) > SMALL_WRITE_ROWS:
            return await self._upsert_now(name, points)
        group = self.write_groups.get(name)
        if group is None:
            group = self.write_groups[name] = GroupCommit(lambda merged: self._upsert_now(name, merged),
                                                          SMALL_WRITE_ROWS)
        return await group.upsert(points)

    async def _upsert_now(self, name: str, points: Points) -> int:
        commit = await self._write(name, lambda c: self.store.upsert(c, points), lambda c, commit: (
            commit, Changes(commit.prev, commit.seq, np.empty(0, np.int64), points.ids, points.vectors,
                            payloads=points.payloads)))
        return commit.seq

    async def delete(self, name: str, ids: np.ndarray) -> tuple[int, int]:
        """Returns how many points existed, and the change seq after which they are gone."""
        def deleted(c: Collection, result: tuple[np.ndarray, Commit]) -> tuple[Commit, Changes]:
            gone, commit = result
            return commit, Changes(commit.prev, commit.seq, gone, np.empty(0, np.int64),
                                   np.empty((0, c.dim), np.float32))

        gone, commit = await self._write(name, lambda c: self.store.delete(c, ids), deleted)
        return len(gone), commit.seq

    async def _write(self, name: str, write: Callable[[Collection], Awaitable[T]],
                     changes: Callable[[Collection, T], tuple[Commit, Changes]]) -> T:
        """Commit a write, then apply it to this process's replica from the request's data. Meanwhile the replica
        knows a commit of its own is on the way, so its notification starts no read-back (Replica.notified)."""
        c = await self.collection(name)
        r = self.by_id.get(c.id)
        if r is not None:
            r.begin_own_write()
        try:
            c, result = await self._with_collection(name, write)
            commit, change = changes(c, result)
            if commit.seq > commit.prev:
                await self._apply_own(c, commit, change)
            return result
        finally:
            if r is not None:
                r.end_own_write()

    async def _apply_own(self, c: Collection, commit: Commit, changes: Changes) -> None:
        """This process's replica takes its own committed write before the ack. If that fails, the write is still
        acknowledged (it is committed) and the next catch-up brings it in."""
        name = c.name
        r = self.by_id.get(c.id)
        if r is None or not r.loaded:
            return  # loading replicas catch up from the log when they finish
        if self.shard is not None:
            changes = self.shard.take(changes)
        try:
            await r.apply_own(commit, changes)
        except Exception as exc:  # noqa: BLE001 - the log still holds the change
            log.warning("collection %s: applying committed seq %d failed (%s: %s); a catch-up will bring it in",
                        name, commit.seq, type(exc).__name__, exc)
            r.wake(time.monotonic())
            return
        self._maybe_rebuild(r)

    async def bulk_upsert(self, name: str, chunks: Iterator[Points], total: int, progress: Progress,
                          fallback: str = "background") -> dict[str, Any]:
        """A large load in committed chunks (each chunk acknowledged once committed), then index builds. `chunks`
        may read a file: it is advanced in a worker thread, one chunk in memory at a time."""
        done = 0
        r = self.resident.get(name)
        if r is not None:
            r.bulk_loading += 1
        try:
            while (points := await asyncio.to_thread(next, chunks, None)) is not None:
                await self.upsert(name, points)
                done += len(points.ids)
                progress(done, total, f"stored {done} of {total} points")
        finally:
            if r is not None:
                r.bulk_loading -= 1
        built = await self.build(name, lambda _done, _total, message: progress(done, total, message), fallback)
        return {"upserted": done, **built}

    async def build(self, name: str, progress: Progress | None = None, fallback: str = "background") -> dict[str, Any]:
        """Compact and rebuild the resident index, and create the pgvector index if it is missing.

        While a resident index serves, pgvector's is only the fallback: with `fallback="background"` it is built
        after this returns, CONCURRENTLY (writes go on), and describe() says "building" meanwhile; "wait" builds
        it before returning, as it always is when pgvector is the serving engine."""
        c = await self.collection(name)
        r = self.resident.get(name)
        say = progress or (lambda done, total, message: None)
        out = await self.rebuild_resident(name, lambda message: say(0, None, message))
        if name in self.fallback_builds or await pgvector_search.has_index(self.pool, c):
            return out
        if fallback == "background" and r is not None and r.loaded and r.index.index is not None:
            out["pgvector_index"] = "building"
            self.fallback_builds.add(name)
            self._spawn(self._build_fallback(c), f"building the pgvector index of {name}")
            return out
        say(0, None, "building the pgvector index")
        started = time.perf_counter()
        out["pgvector_index"] = await pgvector_search.build_index(self.pool, c, await self.store.count(c))
        out["pgvector_build_s"] = round(time.perf_counter() - started, 3)
        return out

    async def rebuild_resident(self, name: str, say: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Compact and rebuild this process's resident index of the collection, if it holds one."""
        r = self.resident.get(name)
        if r is None or not r.loaded:
            return {}
        started = time.perf_counter()
        await self._rebuild(r, say)
        return {"resident_build_s": round(time.perf_counter() - started, 3),
                "resident_index": r.index.index.config.index_type if r.index.index is not None else None}

    async def _build_fallback(self, c: Collection) -> None:
        started = time.perf_counter()
        try:
            await pgvector_search.build_index(self.pool, c, await self.store.count(c), concurrently=True)
            log.info("collection %s: pgvector index built in the background in %.1f s", c.name,
                     time.perf_counter() - started)
        finally:
            self.fallback_builds.discard(c.name)

    async def _rebuild(self, r: Replica, say: Callable[[str], None] | None) -> None:
        """Rebuild now, through the collection's one rebuild slot: a rebuild already running that started before
        this call is waited for, then another runs (it may be a background one that started meanwhile) unless
        the one waited for left nothing to compact."""
        asked = time.monotonic()
        while True:
            task = r.rebuild_task
            if task is None or task.done():
                await asyncio.shield(self._start_rebuild(r, say))
                return
            if r.rebuild_started >= asked:
                await asyncio.shield(task)
                return
            await asyncio.gather(task, return_exceptions=True)
            if r.index.compact:  # the rebuild that was running already covers every row (a bulk load's)
                return

    def _start_rebuild(self, r: Replica, say: Callable[[str], None] | None) -> asyncio.Task:
        async def rebuild() -> None:
            index, kind = r.index, self._kind_of(r)
            loop = asyncio.get_running_loop()
            builder = getattr(self.backends[kind], "builder", None)
            if builder is None:
                await loop.run_in_executor(self.build_executors[kind], build_and_calibrate, index, say)
            else:  # the build in a child process, the rest (load, swap, calibration) on the engine's thread
                pending = await loop.run_in_executor(self.build_executors[kind], build_detached, index, builder,
                                                     self.data_dir / "builds", say)
                await loop.run_in_executor(self.executors[kind], build_and_calibrate, index, say, pending)
            self._snapshot_soon(r)

        r.rebuild_started = time.monotonic()
        r.rebuild_task = task = asyncio.ensure_future(rebuild())
        return task

    def _maybe_rebuild(self, r: Replica) -> None:
        if r.bulk_loading or not r.loaded:
            return
        if (r.rebuild_task is None or r.rebuild_task.done()) and r.index.needs_rebuild():
            self._spawn(asyncio.shield(self._start_rebuild(r, None)), f"background rebuild of {r.collection.name}")

    # -- reads -----------------------------------------------------------------------------------------
    def engine_order(self, r: Replica | None, engine: str) -> list[str]:
        resident_kind = self._serving_kind(r)
        if engine == "auto":
            return ([resident_kind] if resident_kind else []) + ["pgvector"]
        if engine == "pgvector":
            return ["pgvector"]
        if resident_kind == engine:
            return [engine]
        raise EngineUnavailable(f"engine {engine!r} cannot serve this collection: {self._why_not(r, engine)}",
                                field="engine")

    def _serving_kind(self, r: Replica | None) -> str | None:
        """The resident engine that serves the collection now ("cpu" or "gpu"), if any."""
        return self._kind_of(r) if r is not None and r.loaded else None

    def _why_not(self, r: Replica | None, engine: str) -> str:
        resident_kind = self._serving_kind(r)
        return (f"the collection is resident on the {resident_kind} engine" if resident_kind else
                "the collection's resident index is still loading" if r is not None and not r.loaded else
                f"no {engine} engine is available here")

    async def search(self, name: str, queries: np.ndarray, k: int, engine: str = "auto",
                     params: dict[str, Any] | None = None, payload_filter: dict[str, Any] | None = None,
                     single: bool = False, consistency: str | None = None, seq: int | None = None,
                     recall_target: float | None = None) -> SearchAnswer:
        """`payload_filter` is the filter language of indexes/filters.py; `recall_target` (instead of `params`)
        picks calibrated parameters on the resident engine (indexes/planner.py)."""
        arrived = time.monotonic()
        c, level, where = await self.check_search(name, queries, k, consistency, seq, params, payload_filter,
                                                  recall_target)
        r = self.resident.get(name)
        order = self.engine_order(r, engine)  # a resident engine in it only where there is a replica
        fallback = None
        if order[0] != "pgvector" and r is not None and not r.satisfies(level, seq, arrived, self.consistency.bound_s):
            try:
                async with asyncio.timeout(self.consistency.timeout_s):  # not wait_for: see indexes/follower.py
                    await r.reach(level, seq, arrived, self.consistency.bound_s)
            except CollectionNotFound:
                self._forget(name)
                raise
            except Exception as exc:  # noqa: BLE001 - the database is slow or gone: say so, or let pgvector answer
                reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                why = (f"the {ENGINE_KIND[order[0]]} replica could not reach consistency {level!r} within "
                       f"{self.consistency.timeout_s * 1000:.0f} ms ({reason})")
                if engine != "auto":
                    raise NotCaughtUp(why, field="consistency") from exc
                order, fallback = ["pgvector"], why + "; served by pgvector"
        return await self._search(c, r, order, queries, k, engine, params, where, single, fallback, recall_target)

    async def check_search(self, name: str, queries: np.ndarray, k: int, consistency: str | None, seq: int | None,
                           params: dict[str, Any] | None, payload_filter: dict[str, Any] | None,
                           recall_target: float | None) -> tuple[Collection, str, filters.Node | None]:
        """A search's 422s, before any engine sees it: the collection, the consistency level and the parsed filter."""
        level = consistency or self.consistency.default
        check_level(level, seq)
        where = filters.parse(payload_filter)
        check_target(recall_target, params)
        c = await self.collection(name)
        if queries.shape[1] != c.dim:
            raise InvalidInput(f"query has dimension {queries.shape[1]}, the collection has {c.dim}", field="vector")
        if not 1 <= k <= MAX_K:
            raise InvalidInput(f"must be from 1 to {MAX_K}", field="k")
        return c, level, where

    def search_now(self, name: str, query: np.ndarray, k: int, engine: str, params: dict[str, Any] | None,
                   consistency: str | None, seq: int | None, payload_filter: dict[str, Any] | None = None,
                   recall_target: float | None = None,
                   deliver: Callable[[SearchAnswer], None] | None = None) -> SearchAnswer | None:
        """One query answered at once on the event loop, or None: whatever would have to wait (a catch-up for the
        consistency level, an engine slot, the micro-batcher's thread), fail, or leave the resident engine goes
        through search(), which answers it or says why not. Searches are reads, so the caller may run the same
        request again there. `deliver`, if given, gets the answer as soon as it is found, before the slot and the
        metrics are seen to (its caller's client need not wait for them)."""
        arrived = time.monotonic()
        c, r = self.catalog.get(name), self.resident.get(name)
        level = consistency or self.consistency.default
        if (c is None or r is None or not r.loaded or query.shape != (c.dim,) or not 1 <= k <= MAX_K
                or engine not in ("auto", "cpu") or self._kind_of(r) != "cpu"):
            return None
        index, served = r.index, ENGINE_KIND["cpu"]
        try:
            check_level(level, seq)
            checked_items = search_params(index.index.config.index_type if index.index is not None else resolve_type(
                c.index_type, index.count), params)
            where, run = filters.parse(payload_filter), None
            if where is not None or recall_target is not None:
                check_target(recall_target, params)
                key, run = self._planned(r, k, checked_items, where, recall_target)
            else:
                key = (name, k, checked_items)
        except InvalidInput:
            return None
        if (not r.satisfies(level, seq, arrived, self.consistency.bound_s) or self.guard.cooling(served)
                or not (slot := self.guard.try_slot(served))):
            return None
        started = time.perf_counter()
        try:
            found = self.batchers["cpu"].try_now(key, query, run)
        except Exception:  # noqa: BLE001 - search() runs it again and reports the failure as usual
            found = None
        took = time.perf_counter() - started
        if found is None:
            slot.release(None)
            return None
        if run is None:
            ids, distances, watermark = found
            found = SearchResult([ids], [distances], watermark)
        answer = SearchAnswer(found, served, round(took * 1000, 3))
        try:
            if deliver is not None:
                deliver(answer)
        finally:
            slot.release(took)
            self.guard.succeeded(served)
            self.observe(served, "search", took, True)
        return answer

    async def _search(self, c: Collection, r: Replica | None, order: list[str], queries: np.ndarray, k: int,
                      engine: str, params: dict[str, Any] | None, where: filters.Node | None,
                      single: bool, fallback: str | None, recall_target: float | None) -> SearchAnswer:
        if engine == "auto" and order == ["pgvector"] and r is not None and fallback is None:
            fallback = (f"the resident index failed to load ({r.error})" if r.error
                        else "the resident index is still loading")
        for position, choice in enumerate(order):
            served = "pgvector" if choice == "pgvector" else ENGINE_KIND[choice]
            last = position + 1 == len(order)
            if not last and (why := self.guard.cooling(served)):
                fallback = f"the {served} engine {why}; served by {order[position + 1]}"
                continue
            async with self.guard.slot(served):
                started = time.perf_counter()
                try:
                    if choice == "pgvector":
                        pg_params = pgvector_search.check_search_params(params if engine == "pgvector" else None)
                        result = await pgvector_search.search(self.pool, c, queries, k, pg_params, where)
                    else:
                        assert r is not None  # engine_order named a resident engine
                        result = await self._search_resident(r, queries, k, params, where, single, recall_target)
                except (InvalidInput, EngineUnavailable):
                    raise
                except asyncpg.UndefinedTableError:
                    self._forget(c.name)
                    raise CollectionNotFound(f"no collection named {c.name!r}", field="collection") from None
                except Exception as exc:  # noqa: BLE001 - an engine failure falls back under auto
                    self.observe(served, "search", time.perf_counter() - started, False)
                    self.guard.failed(served, exc)
                    if last:
                        raise EngineFailed(f"engine {choice} failed: {type(exc).__name__}: {exc}") from exc
                    # The exception's text goes to the log, under an id the answer carries: never to clients.
                    error_id = uuid.uuid4().hex[:16]
                    log.warning("engine %s failed on %s (error id %s), falling back to %s", choice, c.name, error_id,
                                order[position + 1], exc_info=exc)
                    fallback = f"the {served} engine failed (error id {error_id}); served by {order[position + 1]}"
                    continue
                took = time.perf_counter() - started
                self.guard.succeeded(served)
                self.observe(served, "search", took, True)
                return SearchAnswer(result, served, round(took * 1000, 3), fallback)
        raise EngineUnavailable("no engine can serve this collection", field="engine")

    async def _search_resident(self, r: Replica, queries: np.ndarray, k: int, params: dict[str, Any] | None,
                               where: filters.Node | None, single: bool, recall_target: float | None) -> SearchResult:
        index = r.index
        index_type = index.index.config.index_type if index.index is not None else resolve_type(
            r.collection.index_type, index.count)
        checked_items = search_params(index_type, params)
        checked = dict(checked_items)
        if where is not None or recall_target is not None:
            # The resident payload index evaluates the filter: no PostgreSQL query on this path.
            if single and len(queries) == 1:  # its cost learnt, so that search_now may answer the next ones
                key, run = self._planned(r, k, checked_items, where, recall_target)
                return (await r.run(self.batchers[self._kind_of(r)].timed, key, queries, run))[0]
            return await r.run(index.search, queries, k, checked, where, recall_target)
        if single and len(queries) == 1:
            key = (r.collection.name, k, checked_items)
            ids, distances, watermark = await self.batchers[self._kind_of(r)].submit(key, queries[0])
            return SearchResult([ids], [distances], watermark)
        return await r.run(index.search, queries, k, checked, None)

    @staticmethod
    def _planned(r: Replica, k: int, checked_items: tuple, where: filters.Node | None,
                 recall_target: float | None) -> tuple[tuple, Callable[[np.ndarray], list[SearchResult]]]:
        """A filtered or recall-targeted search of one query: its micro-batcher key (for its cost) and the search.
        filters.key, not the tree, keys it: True == 1.0 in Python, but {"f": true} is no {"f": 1}."""
        index, checked = r.index, dict(checked_items)
        key = (r.collection.name, k, checked_items, where and filters.key(where), recall_target)
        return key, lambda queries: [index.search(queries, k, checked, where, recall_target)]

    def _run_batch(self, key: tuple, queries: np.ndarray) -> list[tuple[list[int], list[float], int | None]]:
        name, k, params = key
        r = self.resident.get(name)
        if r is None:
            raise CollectionNotFound(f"no collection named {name!r}", field="collection")
        result = r.index.search(queries, k, dict(params))
        return [(ids, d, result.watermark) for ids, d in zip(result.ids, result.distances)]

    def _uncontended(self, key: tuple) -> bool:
        r = self.resident.get(key[0])
        return r is not None and not r.index.lock.contended

    def _kind_of(self, r: Replica) -> str:
        return r.index.backend.kind

    # -- recall ----------------------------------------------------------------------------------------
    async def recall(self, name: str, k: int, engine: str, params: dict[str, Any] | None, sample: int,
                     queries: np.ndarray | None, seed: int, recall_target: float | None = None) -> dict[str, Any]:
        """recall@k of `engine` against exact search over the same stored vectors."""
        c = await self.collection(name)
        r = self.resident.get(name)
        if r is not None and r.loaded:
            ids, data = await r.run(r.index.live)
        else:
            ids, vectors = await self.store.rows(c)
            data = await asyncio.to_thread(prepare, np, vectors, c.metric)
        if len(ids) == 0:
            raise CollectionEmpty("the collection is empty: upsert points first", field="collection")
        if queries is None:
            rng = np.random.default_rng(seed)
            picked = rng.choice(len(ids), size=min(sample, len(ids)), replace=False)
            queries = data[np.sort(picked)]
        if queries.shape[1] != c.dim:
            raise InvalidInput(f"queries have dimension {queries.shape[1]}, the collection has {c.dim}",
                               field="queries")
        # Exact search over every row: seconds of CPU for large collections, so off the event loop.
        truth_scores, truth_rows = await asyncio.to_thread(exact_search, np, data, prepare(np, queries, c.metric), k,
                                                           c.metric)
        # The same replica state the exact answer came from: no catch-up in between.
        answer = await self.search(name, queries, k, engine, params, consistency="eventually",
                                   recall_target=recall_target)
        truth_d = from_engine(np, truth_scores, c.metric)
        hits = 0
        for qi, got in enumerate(answer.result.ids):
            exact_ids = set(ids[truth_rows[qi][truth_rows[qi] >= 0]].tolist())
            kth = truth_d[qi][min(k, len(exact_ids)) - 1]
            # A returned id counts when it is a true neighbour, or ties the k-th true distance.
            for got_id, got_d in zip(got, answer.result.distances[qi]):
                if got_id in exact_ids or got_d <= kth + 1e-5 * max(1.0, abs(kth)):
                    hits += 1
        denominator = sum(min(k, len(ids)) for _ in range(len(queries)))
        return {"recall": hits / denominator, "k": k, "queries": len(queries), "engine": answer.engine,
                "fallback": answer.fallback, "params": params or {}, "search_ms": answer.took_ms,
                "plan": answer.result.plan}

    # -- start-up and snapshots ------------------------------------------------------------------------
    async def _load_all(self) -> None:
        if self.resident_kind is None:
            return
        for c in await self.store.list():
            self._register(self._new_replica(c))
        for r in list(self.resident.values()):
            await self._load_one(r)
        self._sync_catalog()  # collections created while this process loaded

    async def _load_one(self, r: Replica) -> None:
        try:
            await self._load(r)
            r.loaded = True
            r.wake(time.monotonic())  # commits made while it loaded
            self._maybe_rebuild(r)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one broken collection must not stop the others
            log.exception("loading collection %s failed; pgvector serves it", r.collection.name)
            r.error = f"{type(exc).__name__}: {exc}"

    async def _load(self, r: Replica) -> None:
        c = r.collection
        started = time.perf_counter()
        state = await self.snapshots.usable(r)
        if state is not None:
            try:
                await r.run(r.index.restore, state)
            except ValueError as exc:
                log.warning("collection %s: unusable snapshot (%s): rebuilding from PostgreSQL", c.name, exc)
                r.index, state = r.new_index(), None
        await r.ensure_fresh(time.monotonic())  # everything after the snapshot, or everything
        if state is None or r.index.needs_rebuild():
            await asyncio.get_running_loop().run_in_executor(self.build_executors[self._kind_of(r)],
                                                             build_and_calibrate, r.index, None)
        r.loaded_from = "snapshot" if state is not None else "postgres"
        log.info("collection %s: %d vectors resident on %s at seq %d in %.2f s (from %s)", c.name, r.index.count,
                 r.index.backend.name, r.watermark, time.perf_counter() - started, r.loaded_from)
        if state is None:
            await self._save_snapshot(r)

    def _snapshot_soon(self, r: Replica) -> None:
        """Snapshot the replica once its rebuilds have paused for SNAPSHOT_QUIET_S: a snapshot is a cache for the
        next start (stop() writes every one), and writing one after each rebuild of a collection filled by a
        stream of writes cost more than the rebuilds (600 MB for 100,000 x 768 vectors and its HNSW index)."""
        r.snapshot_after = time.monotonic() + SNAPSHOT_QUIET_S
        if r.snapshot_task is None or r.snapshot_task.done():
            r.snapshot_task = self._spawn(self._snapshot_when_quiet(r), f"snapshot of {r.collection.name}")

    async def _snapshot_when_quiet(self, r: Replica) -> None:
        while (wait := r.snapshot_after - time.monotonic()) > 0 or (r.rebuild_task and not r.rebuild_task.done()):
            await asyncio.sleep(max(wait, 0.1))
        await self._save_snapshot(r)

    async def _save_snapshot(self, r: Replica) -> None:
        if self.resident.get(r.collection.name) is r:  # not dropped meanwhile
            await self.snapshots.save(r)

    async def save_snapshots(self) -> None:
        for r in list(self.resident.values()):
            if r.loaded:
                try:
                    await self._save_snapshot(r)
                except Exception:  # noqa: BLE001
                    log.exception("snapshot of %s failed (Postgres still holds every point)", r.collection.name)
