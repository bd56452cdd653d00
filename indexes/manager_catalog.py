"""Collections' lifecycle in this process: create, drop, describe; replicas registered, loaded at start-up (from a
snapshot or PostgreSQL) and kept in step with the catalog other processes change (the follower's calls)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable

import asyncpg

from . import pgvector_search, reports
from .ann import INDEX_TYPES, check_build_shape, check_params
from .distance import METRICS
from .errors import CollectionNotFound, InvalidInput
from .manager_builds import Builds, build_and_calibrate
from .manager_state import HEAVY_WORK
from .replica import Replica
from .resident import Changes, ResidentCollection
from .store import Collection
from .tasks import stop_tasks

log = logging.getLogger("switchyard.vectors")


class Catalog(Builds):
    """Collections and their replicas here: created, dropped, described, loaded, and in step with other processes
    (a loaded replica may need a rebuild, hence over Builds)."""

    # -- collections -----------------------------------------------------------------------------------
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
            r.settled.set()
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
            heavy = kind == "cpu" and HEAVY_WORK.get()  # the GPU's work stays on the thread that holds its context
            executor = self.heavy_executor if heavy else self.executors[kind]
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

        async def read_changes(since: int) -> Changes:
            changes = await self.store.read_changes(c, since)
            return changes if self.shard is None else self.shard.take(changes)

        return Replica(c, new_index(), read_changes, run, new_index, self.on_applied, self._followed)

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

    # -- start-up and shutdown -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.follower.start()  # listening before loading: nothing committed meanwhile is missed
        self.loading = asyncio.create_task(self._load_all())
        self.loading.add_done_callback(self._loaded_all)

    def _loaded_all(self, loading: asyncio.Task) -> None:
        """Then the collections created while it loaded: a catalog event meanwhile was left to the initial load."""
        if not loading.cancelled():
            self._sync_catalog()

    async def stop(self) -> None:
        await self.follower.stop()
        for backend in self.backends.values():  # a build still running in a child process is not waited for
            if (builder := getattr(backend, "builder", None)) is not None:
                builder.stop()
        await stop_tasks(self.loading, self._syncing, *self._background)
        for r in list(self.resident.values()):
            await r.stop()
        await self.save_snapshots()
        for executor in {*self.executors.values(), *self.build_executors.values(), self.heavy_executor}:
            executor.shutdown(wait=True)

    async def _load_all(self) -> None:
        if self.resident_kind is None:
            return
        for c in await self.store.list():
            self._register(self._new_replica(c))
        for r in list(self.resident.values()):
            await self._load_one(r)

    async def _load_one(self, r: Replica) -> None:
        try:
            await self._load(r)
            r.loaded = True
            r.wake(time.monotonic())  # commits made while it loaded
            self._maybe_rebuild(r)
        except asyncio.CancelledError:
            raise
        except (asyncpg.UndefinedTableError, CollectionNotFound):  # a catalog read just before a drop registered it
            log.info("collection %s was dropped while it loaded", r.collection.name)
            if self.by_id.get(r.collection.id) is r:
                self._forget(r.collection.name)
        except Exception as exc:  # noqa: BLE001 - one broken collection must not stop the others
            log.exception("loading collection %s failed; pgvector serves it", r.collection.name)
            r.error = f"{type(exc).__name__}: {exc}"
        finally:
            r.settled.set()

    async def wait_loaded(self, name: str, timeout_s: float) -> bool:
        """Whether this process's replica of the collection is loaded, after waiting up to timeout_s for a load in
        progress (a collection another process created a moment ago)."""
        r = self.resident.get(name)
        if r is None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(r.settled.wait(), timeout_s)
        return r.loaded

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
        r.layout_seq = int(state["watermark"]) if state is not None else r.watermark
        log.info("collection %s: %d vectors resident on %s at seq %d in %.2f s (from %s)", c.name, r.index.count,
                 r.index.backend.name, r.watermark, time.perf_counter() - started, r.loaded_from)
        if state is None:
            await self._save_snapshot(r)
