"""One collection's resident replica in this process, and how it keeps up with PostgreSQL's change log.

Changes arrive one at a time, by `catch_up` (one consistent read of the log after the watermark, applied in one
step, which also proves the replica fresh as of the read's start) or `apply_own` (this process's own commit when it
is the very next change, else a catch-up), so a failure between a commit and its apply is repaired by the next
catch-up. Consistency levels become a moment to be fresh as of: strong = the search's arrival, session = the
client's seq, bounded = the arrival minus the staleness bound, eventually = nothing. See docs/consistency.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import asyncpg

from .errors import CollectionNotFound, InvalidInput
from .resident import Changes, ResidentCollection
from .store import Collection, Commit
from .tasks import stop_tasks

log = logging.getLogger("switchyard.vectors")

LEVELS = ("strong", "session", "bounded", "eventually")

# (collection id, seq, commit time as epoch seconds or None) for each commit a replica applies.
Applied = Callable[[int, int, float | None], None]


def check_level(level: str, seq: int | None) -> None:
    if level not in LEVELS:
        raise InvalidInput(f"must be one of {', '.join(LEVELS)}", field="consistency")
    if level == "session" and seq is None:
        raise InvalidInput("consistency 'session' needs the seq your write returned", field="seq")
    if seq is not None and seq < 0:
        raise InvalidInput("must be a change seq (0 or more)", field="seq")


@dataclass
class Replica:
    collection: Collection
    index: ResidentCollection
    read_changes: Callable[[int], Awaitable[Changes]]  # since -> the log after it
    run: Callable[..., Awaitable[Any]]  # run a blocking call on the engine's executor
    new_index: Callable[[], ResidentCollection]
    on_applied: Applied = lambda collection_id, seq, at: None
    # After a catch-up applied changes (other processes' writes): (replica, rows written), for background rebuilds.
    on_followed: Callable[["Replica", int], None] = lambda replica, rows: None
    loaded: bool = False
    error: str | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set once loaded, or its load failed
    loaded_from: str | None = None  # "snapshot" (+ catch-up) or "postgres" (rebuilt), said by GET collection
    saved: tuple | None = None  # (watermark, digest, index type) of the last snapshot written
    layout_seq: int = 0  # the seq of the rows its index was last built over, loaded or adopted at
    bulk_loading: int = 0  # bulk loads in progress build once at the end: no background rebuilds meanwhile
    loading_since: float = 0.0  # monotonic time the current run of large writes began (Builds._maybe_rebuild)
    loading_until: float = 0.0  # ... and when it counts as over, unless another large write comes first
    last_load_write: float = 0.0  # ... and when its last large write was applied
    load_gap: float = 0.0  # ... and the longest gap between its large writes so far
    rebuild_timer: asyncio.TimerHandle | None = None  # the check once that run is over
    rebuild_task: asyncio.Task | None = None  # the one rebuild of this collection, background or asked for
    rebuild_started: float = 0.0
    snapshot_after: float = 0.0  # monotonic time before which the pending snapshot waits for more rebuilds
    snapshot_task: asyncio.Future | None = None  # the pending or running snapshot after rebuilds
    fresh_as_of: float = -math.inf  # monotonic time as of which every commit is applied
    own_writes: int = 0  # this process's writes between their COMMIT and their apply
    deferred_seq: int = 0  # the newest commit notified while own writes were in flight
    _task: asyncio.Task | None = field(default=None, repr=False)  # the running catch-up or own apply
    _wanted: float = field(default=-math.inf, repr=False)
    _pump: asyncio.Task | None = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)  # forgotten (its collection dropped, or the service stops)

    @property
    def watermark(self) -> int:
        return self.index.watermark

    # -- catching up -----------------------------------------------------------------------------------
    async def ensure_fresh(self, not_before: float) -> None:
        """Return once a catch-up that started at or after `not_before` has been applied. Concurrent callers
        share catch-ups; the catch-up itself is shielded, so a caller that gives up does not cut it short."""
        while self.fresh_as_of < not_before:
            task = self._task
            if task is None or task.done():
                task = self._task = asyncio.ensure_future(self._catch_up())
            await asyncio.shield(task)

    def satisfies(self, level: str, seq: int | None, arrived: float, bound_s: float) -> bool:
        """Whether the replica already meets `level` for a search that arrived at `arrived` (monotonic)."""
        if level == "eventually":
            return True
        if level == "session" and seq is not None and self.watermark >= seq:
            return True
        return self.fresh_as_of >= (arrived - bound_s if level == "bounded" else arrived)

    async def reach(self, level: str, seq: int | None, arrived: float, bound_s: float) -> None:
        """Wait until the replica meets `level` for a search that arrived at `arrived`."""
        if not self.satisfies(level, seq, arrived, bound_s):
            await self.ensure_fresh(arrived - bound_s if level == "bounded" else arrived)

    async def _catch_up(self) -> None:
        started = time.monotonic()
        changes = await self.read_changes(self.watermark)
        if changes.head < self.watermark:
            # PostgreSQL is behind this replica: the database was restored from an older backup. Start over.
            log.error("collection %s: PostgreSQL's head seq %d is behind the replica's %d; reloading it from "
                      "PostgreSQL", self.collection.name, changes.head, self.watermark)
            self.index = self.new_index()
            changes = await self.read_changes(0)
        if await self.run(self.index.apply, changes):
            for seq, at in changes.commits:
                self.on_applied(self.collection.id, seq, at)
            self.on_followed(self, len(changes.ids))
        self.fresh_as_of = max(self.fresh_as_of, started)

    async def apply_own(self, commit: Commit, changes: Changes) -> None:
        """Apply a write this process committed: directly when it is the next change after the watermark, else
        through a catch-up (which reads it back with whatever else was committed)."""
        while self.watermark < commit.seq:
            task = self._task
            if task is not None and not task.done():
                await asyncio.shield(task)
                continue
            if self.watermark == commit.prev:
                task = self._task = asyncio.ensure_future(self._apply_own(commit, changes))
            else:
                task = self._task = asyncio.ensure_future(self._catch_up())
            await asyncio.shield(task)

    async def adopt(self, state: dict[str, Any]) -> bool:
        """Take a snapshot another process wrote after its rebuild (ResidentCollection.adopt), brought up to date
        from the change log, in turn with catch-ups and own applies, which run one at a time. Whether it was
        taken (not: a snapshot whose rows do not hash to its digest, or the log moved past what was read)."""
        while (task := self._task) is not None and not task.done():
            await asyncio.gather(asyncio.shield(task), return_exceptions=True)
        task = self._task = asyncio.ensure_future(self._adopt(state))
        return await asyncio.shield(task)

    async def _adopt(self, state: dict[str, Any]) -> bool:
        started, before = time.monotonic(), self.watermark
        changes = await self.read_changes(int(state["watermark"]))
        try:
            if not await self.run(self.index.adopt, state, changes):
                return False
        except ValueError as exc:  # the searches and writes waiting for this task must not see it fail
            log.warning("collection %s: the snapshot of another process is unusable (%s)", self.collection.name, exc)
            return False
        self.layout_seq = int(state["watermark"])
        for seq, at in changes.commits:
            if seq > before:
                self.on_applied(self.collection.id, seq, at)
        self.fresh_as_of = max(self.fresh_as_of, started)
        return True

    async def _apply_own(self, commit: Commit, changes: Changes) -> None:
        if await self.run(self.index.apply, changes):
            self.on_applied(self.collection.id, commit.seq, None)

    def notified(self, seq: int) -> None:
        """A commit notification. While this process has writes of its own in flight it is most likely one of
        them, about to be applied from the request's data: reading it back would only repeat the work (a query
        and an apply per write), so the wake waits until they are done."""
        if seq <= self.watermark:
            return
        if self.own_writes:
            self.deferred_seq = max(self.deferred_seq, seq)
        else:
            self.wake(time.monotonic())

    def begin_own_write(self) -> None:
        self.own_writes += 1

    def end_own_write(self) -> None:
        self.own_writes -= 1
        if not self.own_writes and self.deferred_seq > self.watermark:
            self.wake(time.monotonic())

    def wake(self, not_before: float) -> None:
        """Catch up in the background (a notification or the poll saw a newer head); never once stopped (a write
        in flight when its collection was dropped ends by calling this)."""
        if self._stopped:
            return
        self._wanted = max(self._wanted, not_before)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._pump_loop())

    async def _pump_loop(self) -> None:
        delay = 0.05
        while self.fresh_as_of < self._wanted:
            try:
                await self.ensure_fresh(self._wanted)
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except (CollectionNotFound, asyncpg.UndefinedTableError):  # ids are never reused: gone for good
                log.info("collection %s was dropped: its replica stops catching up", self.collection.name)
                return
            except Exception as exc:  # noqa: BLE001 - retried: the log still holds every change
                log.warning("collection %s: catch-up failed (%s: %s); retrying", self.collection.name,
                            type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def note_head(self, head: int, read_at: float) -> None:
        """The poll read the collection's head at `read_at`: fresh as of then if nothing is missing."""
        if head <= self.watermark:
            self.fresh_as_of = max(self.fresh_as_of, read_at)
        else:
            self.wake(read_at)

    async def stop(self) -> None:
        self._stopped = True
        await stop_tasks(self._pump, self.rebuild_task, self._task)

    # -- reporting -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        idx = self.index.index
        now = time.monotonic()
        return {
            "resident": True, "loaded": self.loaded, "error": self.error, "engine": self.index.backend.name,
            "index_type": idx.config.index_type if idx is not None else None,
            "indexed_rows": self.index.indexed_rows, "delta_rows": self.index.delta_rows,
            "dead_rows": self.index.n_dead, "watermark": self.watermark,
            "fresh_ms": round(1000 * (now - self.fresh_as_of), 1) if math.isfinite(self.fresh_as_of) else None,
            "rebuilding": self.rebuild_task is not None and not self.rebuild_task.done(),
            "loaded_from": self.loaded_from,
        }
