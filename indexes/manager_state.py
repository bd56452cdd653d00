"""What every part of CollectionManager shares: its engines, caches and background tasks, set up here, and the
snapshot writes that rebuilds and shutdown both make.

The parts (manager_builds.py, manager_catalog.py, manager_writes.py, manager_search.py, manager_recall.py) are
classes over this one, composed into CollectionManager (manager.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar, cast

import asyncpg

from . import snapshots
from .batching import MicroBatcher
from .errors import CollectionNotFound
from .follower import Follower, FollowerHandler
from .group_commit import GroupCommit
from .replica import Applied, Replica
from .resident import IndexBackend, RebuildPolicy
from .shards import Shard
from .store import MAX_PAYLOAD_KEYS, Collection, CollectionStore
from .vectors import MAX_PAYLOAD_ROW_BYTES, MAX_PAYLOAD_VALUE_BYTES

ENGINE_KIND = {"gpu": "cuvs", "cpu": "faiss"}  # each resident kind's usual engine (see engine_name)

log = logging.getLogger("switchyard.vectors")

SNAPSHOT_QUIET_S = 2.0  # see _snapshot_soon
T = TypeVar("T")
# Set while a heavy-class request (recall) runs: its resident CPU work goes to heavy_executor too, whose thread the
# service runs at a lower CPU priority, so a recall's batch search of thousands of queries yields to searches.
HEAVY_WORK: ContextVar[bool] = ContextVar("switchyard_heavy_work", default=False)


@dataclass(frozen=True)
class Consistency:
    """How searches meet their consistency level (see indexes/replica.py)."""

    default: str = "bounded"
    bound_s: float = 1.0  # bounded staleness: resident state at most this old
    timeout_s: float = 2.0  # how long a search may wait to reach its level before falling back / 503
    poll_s: float = 0.2  # the followers' poll of every collection's head


class ManagerState:
    """The state the parts of CollectionManager share, and the helpers they all use."""

    def __init__(self, pool: asyncpg.Pool, data_dir: Path, *, dsn: str | None = None, max_batch: int = 64,
                 batch_window_s: float = 0.0, inline_search_s: float = 0.0, inline_turn_s: float = 0.003,
                 observe: Callable[[str, str, float, bool], None] | None = None,
                 consistency: Consistency | None = None, policy: RebuildPolicy | None = None,
                 on_applied: Applied | None = None, guard: Any = None, shard: Shard | None = None,
                 max_payload_keys: int = MAX_PAYLOAD_KEYS, max_payload_value_bytes: int = MAX_PAYLOAD_VALUE_BYTES,
                 max_payload_row_bytes: int = MAX_PAYLOAD_ROW_BYTES,
                 thread_init: Callable[[], None] | None = None, heavy_threads: int = 1,
                 lower_database_process: Callable[[int], None] | None = None, siblings: bool = False) -> None:
        self.store = CollectionStore(pool, max_payload_keys, max_payload_value_bytes, max_payload_row_bytes)
        self.pool = pool
        self.data_dir = data_dir
        self.snapshots = snapshots.Snapshots(data_dir / "vectors", self.store)
        self.backends: dict[str, IndexBackend] = {}  # "gpu"/"cpu" -> backend that keeps indexes resident
        self.executors: dict[str, ThreadPoolExecutor] = {}  # searches and change applies
        self.build_executors: dict[str, ThreadPoolExecutor] = {}  # rebuilds
        # Heavy work of the heavy class (recall's exact ground truth): its thread starts with `thread_init`, which
        # the service gives a lower CPU priority (service/admission/priority.py), so searches are not slowed by it.
        self.thread_init = thread_init  # the build threads' too (manager.attach)
        self.lower_database_process = lower_database_process  # see pgvector_search.build_index
        self.heavy_executor = ThreadPoolExecutor(max_workers=1, initializer=thread_init,
                                                 thread_name_prefix="vectors-heavy")
        self.heavy_threads = heavy_threads  # OpenMP threads of its calls
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
        # Other processes hold replicas of the same collections in this data directory (workers, engine processes):
        # one rebuild at a time among them, the others take its snapshot (manager_builds.py).
        self.siblings = siblings and shard is None
        self.loading: asyncio.Task | None = None
        self.catalog: dict[str, Collection] = {}  # name -> definition; definitions never change
        self.process = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        # The catalog part (manager_catalog.py) answers the follower's calls.
        self.follower = Follower(dsn, self.store, cast(FollowerHandler, self), process=self.process,
                                 poll_s=self.consistency.poll_s)
        self._syncing: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    def engine_name(self, kind: str) -> str:
        """The engine that serves a resident kind ("gpu": cuVS, or CuPy's exact engine where cuVS is absent)."""
        backend = self.backends.get(kind)
        return getattr(backend, "name", None) or ENGINE_KIND[kind]

    @property
    def resident_kind(self) -> str | None:
        """Where new resident indexes live: the GPU when there is one, else the CPU."""
        return "gpu" if "gpu" in self.backends else "cpu" if "cpu" in self.backends else None

    @property
    def ready(self) -> bool:
        return (self.loading is not None and self.loading.done()
                and all(r.loaded or r.error for r in self.resident.values()))

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
        c = await self.collection(name)  # CollectionNotFound when it is gone
        try:
            return c, await fn(c)
        except asyncpg.UndefinedTableError:
            raise self._vanished(name) from None  # re-created and dropped again meanwhile

    def _vanished(self, name: str) -> CollectionNotFound:
        """A collection whose table went away during a request (dropped here or by another process): what this
        process cached of it forgotten, the not-found to raise."""
        self._forget(name)
        return CollectionNotFound(f"no collection named {name!r}", field="collection")

    def _forget(self, name: str) -> None:
        """Drop this process's cached definition and replica of a collection (dropped here or elsewhere)."""
        self.write_groups.pop(name, None)
        self.catalog.pop(name, None)
        r = self.resident.pop(name, None)
        if r is not None:
            self.by_id.pop(r.collection.id, None)
            self._spawn(r.stop(), f"stopping the replica of {name}")

    def _kind_of(self, r: Replica) -> str:
        return r.index.backend.kind

    # -- snapshots -------------------------------------------------------------------------------------
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
