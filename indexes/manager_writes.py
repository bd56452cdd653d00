"""Writes: committed in PostgreSQL (small concurrent upserts grouped into one transaction), then applied to this
process's replica before the ack; bulk loads in committed chunks, then a build."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import numpy as np

from .errors import InvalidInput
from .group_commit import GroupCommit
from .manager_builds import Builds, Progress
from .resident import Changes
from .store import SMALL_WRITE_ROWS, Collection, Commit
from .vectors import Points, check_nonzero

log = logging.getLogger("switchyard.vectors")

T = TypeVar("T")


class Writes(Builds):
    """Upserts, deletes and bulk loads (after which the replica may need a rebuild, hence over Builds)."""

    async def upsert(self, name: str, points: Points, field: str = "vectors") -> int:
        """Returns the change seq of the write; acknowledged data is committed in Postgres. `field`: where the
        request held the vectors, for its 422s."""
        c = await self.collection(name)
        if points.vectors.shape[1] != c.dim:
            raise InvalidInput(f"vectors have dimension {points.vectors.shape[1]}, the collection has {c.dim}",
                               field=field)
        check_nonzero(points.vectors, c.metric, field)  # every write path comes here: JSON, base64, Arrow
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
        self.note_write(r, len(changes.ids))
        self._maybe_rebuild(r)

    async def bulk_upsert(self, name: str, chunks: Iterator[Points], total: int, progress: Progress,
                          fallback: str = "background") -> dict[str, Any]:
        """A large load in committed chunks (each chunk acknowledged once committed), then index builds. `chunks`
        may read a file: it is advanced in a worker thread, one chunk in memory at a time."""
        done, seq = 0, None
        r = self.resident.get(name)
        if r is not None:
            r.bulk_loading += 1
        try:
            while (points := await asyncio.to_thread(next, chunks, None)) is not None:
                seq = await self.upsert(name, points)
                done += len(points.ids)
                progress(done, total, f"stored {done} of {total} points")
        finally:
            if r is not None:
                r.bulk_loading -= 1
        built = await self.build(name, lambda _done, _total, message: progress(done, total, message), fallback)
        return {"upserted": done, "seq": seq, **built}  # seq: the last chunk's, for read-your-writes
