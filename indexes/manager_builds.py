"""Rebuilds of resident indexes (compaction, calibration) and the pgvector index's build, asked for or in the
background after writes: one rebuild at a time per collection."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Callable

import asyncpg

from . import pgvector_search
from .build_lock import BuildLock
from .build_process import DetachedBuilder
from .errors import CollectionNotFound
from .manager_state import ManagerState
from .planner import CALIBRATION_QUERIES
from .replica import Replica
from .resident import PendingBuild, ResidentCollection
from .store import Collection

log = logging.getLogger("switchyard.vectors")

Progress = Callable[[int, int | None, str], None]
# Writes of at least LOAD_WRITE_ROWS rows that follow each other within their quiet time are a load: background
# rebuilds wait for it to pause (at most LOAD_MAX_DEFER_S). The quiet time is twice the longest gap between the
# load's writes so far, between LOAD_QUIET_S and LOAD_MAX_QUIET_S: VectorDBBench's two inserters of 5,000 768-d rows
# wrote every 1.4 s, at times in pairs, so a fixed second (or twice the last gap) started a rebuild in the middle of
# the load. Measured in docs/design/vectors.md: 50,000 x 768 in upserts of 5,000 rows spent most of their CPU in
# HNSW builds started during the load.
LOAD_WRITE_ROWS = 1_000
LOAD_QUIET_S = 2.0
LOAD_MAX_QUIET_S = 5.0
LOAD_MAX_DEFER_S = 60.0


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


class Builds(ManagerState):
    """Rebuilds of this process's resident indexes, and pgvector's index."""

    async def build(self, name: str, progress: Progress | None = None, fallback: str = "background") -> dict[str, Any]:
        """Compact and rebuild the resident index, and create the pgvector index if it is missing.

        While a resident index serves, pgvector's is only the fallback: with `fallback="background"` it is built
        after this returns, CONCURRENTLY (writes go on), and describe() says "building" meanwhile; "wait" builds
        it before returning, as it always is when pgvector is the serving engine.

        A collection dropped while its build runs (here or by another process) fails the build with
        CollectionNotFound, whatever the engine or PostgreSQL raised when its table went away."""
        c = await self.collection(name)
        try:
            return await self._build(c, progress, fallback)
        except CollectionNotFound:
            raise
        except (Exception, asyncio.CancelledError) as exc:
            # A dropped collection's replica has its rebuild cancelled (Replica.stop): a CancelledError here is
            # that, unless this call itself is being cancelled (the service stops), which goes on as one.
            task = asyncio.current_task()
            ours = isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling() > 0
            if ours or not await self._dropped(c):
                raise
            raise CollectionNotFound(f"collection {name!r} was deleted while it was being built",
                                     field="collection") from exc

    async def _dropped(self, c: Collection) -> bool:
        """Whether the collection is gone from PostgreSQL (dropped, perhaps re-created under a new id), once a drop
        under way has ended: a drop cancels the collection's index builds before it commits (CollectionStore)."""
        try:
            return await self.store.dropped(c)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
            return False  # the database is unreachable: the failure itself says more

    async def _build(self, c: Collection, progress: Progress | None, fallback: str) -> dict[str, Any]:
        name = c.name
        r = self.resident.get(name)
        say = progress or (lambda done, total, message: None)
        has_fallback = name in self.fallback_builds or await pgvector_search.has_index(self.pool, c)
        resident = self.rebuild_resident(name, lambda message: say(0, None, message))  # made once it will be awaited
        if has_fallback:
            return await resident
        if fallback == "wait":
            # Both indexes wanted now: built side by side, the resident one on its build thread, pgvector's in
            # PostgreSQL's processes (one after the other, a load took their sum).
            say(0, None, "building the pgvector index")
            built = await asyncio.gather(resident, self._timed_pgvector_build(c), return_exceptions=True)
            for result in built:  # both ran to their end; the first failure is the build's
                if isinstance(result, BaseException):
                    raise result
            out, (kind, seconds) = built
        else:
            out = await resident
            if r is not None and r.loaded and r.index.index is not None:
                out["pgvector_index"] = "building"
                if name not in self.fallback_builds:  # another build job may have started one while this rebuilt
                    self.fallback_builds.add(name)
                    self._spawn(self._build_fallback(c), f"building the pgvector index of {name}")
                return out
            say(0, None, "building the pgvector index")  # pgvector serves this collection: needed now
            kind, seconds = await self._timed_pgvector_build(c)
        out["pgvector_index"], out["pgvector_build_s"] = kind, seconds
        return out

    async def _timed_pgvector_build(self, c: Collection) -> tuple[str | None, float]:
        started = time.perf_counter()
        kind = await pgvector_search.build_index(self.pool, c, await self.store.count(c))
        return kind, round(time.perf_counter() - started, 3)

    async def rebuild_resident(self, name: str, say: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Compact and rebuild this process's resident index of the collection, if it holds one, over every write
        committed before the call: another process's writes may not have reached this replica yet."""
        r = self.resident.get(name)
        if r is None or not r.loaded:
            return {}
        started = time.perf_counter()
        await r.ensure_fresh(time.monotonic())
        await self._rebuild(r, say)
        return {"resident_build_s": round(time.perf_counter() - started, 3),
                "resident_index": r.index.index.config.index_type if r.index.index is not None else None}

    async def _build_fallback(self, c: Collection) -> None:
        started = time.perf_counter()
        try:
            await pgvector_search.build_index(self.pool, c, await self.store.count(c), concurrently=True,
                                              background=self.lower_database_process)
            log.info("collection %s: pgvector index built in the background in %.1f s", c.name,
                     time.perf_counter() - started)
        except Exception:
            if not await self._dropped(c):
                raise
            log.info("collection %s was deleted while its pgvector index was being built", c.name)
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
                await asyncio.shield(self._start_rebuild(r, say, asked=True))
                return
            if r.rebuild_started >= asked:
                await asyncio.shield(task)
                return
            await asyncio.gather(task, return_exceptions=True)
            if r.index.compact:  # the rebuild that was running already covers every row (a bulk load's)
                return

    def _start_rebuild(self, r: Replica, say: Callable[[str], None] | None, asked: bool) -> asyncio.Task:
        """The rebuild task. Where other processes share the data directory, one of them rebuilds a collection at a
        time (build_lock.py) and writes its snapshot before the next goes on; the next takes that snapshot if it
        leaves nothing to rebuild (for a rebuild asked for: a compact index; in the background: none due). The
        snapshot is written after the rebuild returns, still under the lock: a load's build is not kept waiting
        for it (100,000 x 768 vectors and their HNSW index are over 600 MB)."""
        async def rebuild() -> None:
            if not self.siblings:
                await self._build_here(r, say)
                self._snapshot_soon(r)
                return
            lock, asked_at = BuildLock(self.snapshots.lock_path(r)), time.perf_counter()
            await lock.acquire()
            saving = None
            try:
                if await self._adopt_sibling(r, asked):
                    return
                log.info("collection %s: rebuilding here (%s, the lock waited for %.1f s)", r.collection.name,
                         "asked for" if asked else "in the background", time.perf_counter() - asked_at)
                await self._build_here(r, say)
                saving = self._spawn(self._save_and_release(r, lock), f"snapshot of {r.collection.name}")
            finally:
                if saving is None:  # adopted, or the build failed: nothing to write
                    lock.release()

        r.rebuild_started = time.monotonic()
        r.rebuild_task = task = asyncio.ensure_future(rebuild())
        return task

    async def _save_and_release(self, r: Replica, lock: BuildLock) -> None:
        try:
            await self._save_snapshot(r)  # before the lock goes: the processes waiting for it take it
        finally:
            lock.release()

    async def _build_here(self, r: Replica, say: Callable[[str], None] | None) -> None:
        index, kind, seq = r.index, self._kind_of(r), r.watermark
        loop = asyncio.get_running_loop()
        builder = getattr(self.backends[kind], "builder", None)
        if builder is None:
            await loop.run_in_executor(self.build_executors[kind], build_and_calibrate, index, say)
        else:  # the build in a child process, the rest (load, swap, calibration) on the engine's thread
            pending = await loop.run_in_executor(self.build_executors[kind], build_detached, index, builder,
                                                 self.data_dir / "builds", say)
            await loop.run_in_executor(self.executors[kind], build_and_calibrate, index, say, pending)
        r.layout_seq = max(r.layout_seq, seq)

    async def _adopt_sibling(self, r: Replica, asked: bool) -> bool:
        """Take the snapshot another process wrote after its rebuild, if it is newer than this replica's index;
        whether that leaves nothing to rebuild here."""
        state = await self.snapshots.newer(r, max(r.layout_seq, r.saved[0] if r.saved else 0))
        if state is None:
            return False
        if not await r.adopt(state):
            return False
        log.info("collection %s: took the index another process built at seq %d, now at seq %d",
                 r.collection.name, state["watermark"], r.watermark)
        return r.index.compact or (not asked and not r.index.needs_rebuild())

    def note_write(self, r: Replica, rows: int) -> None:
        """A write of `rows` was applied: large ones in a row are a load, which builds once when it pauses."""
        if rows < LOAD_WRITE_ROWS:
            return
        now = time.monotonic()
        gap = now - r.last_load_write
        if gap >= LOAD_MAX_QUIET_S:  # the first large write of a load
            r.loading_since, r.load_gap = now, 0.0
        else:
            r.load_gap = max(r.load_gap, gap)
        r.last_load_write = now
        r.loading_until = now + min(LOAD_MAX_QUIET_S, max(LOAD_QUIET_S, 2 * r.load_gap))

    def _followed(self, r: Replica, rows: int) -> None:
        """Another process's writes were applied: they may make a rebuild due here too, as this process's do."""
        if r.loaded:
            self.note_write(r, rows)
            self._maybe_rebuild(r)

    def _maybe_rebuild(self, r: Replica) -> None:
        """Start a background rebuild when the replica needs one. While large writes keep coming (a load through
        upserts), not yet: each rebuild would index all the rows again, so the load is built once it pauses for its
        quiet time (note_write), or every LOAD_MAX_DEFER_S if it never does (searches meanwhile scan the new rows
        exactly)."""
        if r.bulk_loading or not r.loaded or self.resident.get(r.collection.name) is not r:
            return  # the last: dropped (or replaced) while a load's timer waited
        now = time.monotonic()
        if r.rebuild_timer is not None:
            r.rebuild_timer.cancel()
            r.rebuild_timer = None
        if now < r.loading_until and now - r.loading_since < LOAD_MAX_DEFER_S:
            r.rebuild_timer = asyncio.get_running_loop().call_later(r.loading_until - now, self._maybe_rebuild, r)
            return
        if (r.rebuild_task is None or r.rebuild_task.done()) and r.index.needs_rebuild():
            self._spawn(asyncio.shield(self._start_rebuild(r, None, asked=False)),
                        f"background rebuild of {r.collection.name}")
