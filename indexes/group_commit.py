"""Group commit: concurrent small upserts to one collection share one PostgreSQL transaction.

Each upsert waits in its collection's queue; one drain task writes everything queued as one transaction (one
commit, one change-log entry, one catch-up of the resident index) and acknowledges every request in it with that
commit's seq, only after it committed. Upserts that arrive while a group is being written form the next group,
so a lone upsert waits for nothing, and under concurrency the transactions grow instead of queueing. Within a
group a later request's version of an id wins, as if the requests had run one after another. If a group fails,
its requests are retried one by one, so one request's failure is never another's.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import numpy as np

from .vectors import Points


def merge(parts: list[Points]) -> Points:
    """One write equal to `parts` applied in order: the last version of each id, the rest in arrival order."""
    if len(parts) == 1:
        return parts[0]
    ids = np.concatenate([p.ids for p in parts])
    vectors = np.concatenate([p.vectors for p in parts])
    payloads = None
    if any(p.payloads is not None for p in parts):
        payloads = [x for p in parts for x in (p.payloads if p.payloads is not None else [None] * len(p.ids))]
    _, first_from_end = np.unique(ids[::-1], return_index=True)
    keep = np.sort(len(ids) - 1 - first_from_end)
    if len(keep) < len(ids):
        ids, vectors = ids[keep], vectors[keep]
        payloads = [payloads[i] for i in keep] if payloads is not None else None
    return Points(ids, vectors, payloads)


class GroupCommit:
    def __init__(self, write: Callable[[Points], Awaitable[int]], max_rows: int) -> None:
        self._write = write  # commits one upsert, applies it here, returns its seq
        self.max_rows = max_rows
        self._queue: list[tuple[Points, asyncio.Future[int]]] = []
        self._drain_task: asyncio.Task | None = None
        self.groups = 0  # transactions written, and the requests they carried: for tests and metrics
        self.requests = 0

    async def upsert(self, points: Points) -> int:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._queue.append((points, future))
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await future

    def _next_group(self) -> list[tuple[Points, asyncio.Future[int]]]:
        rows, taken = 0, 0
        for points, _ in self._queue:
            if taken and rows + len(points.ids) > self.max_rows:
                break
            rows += len(points.ids)
            taken += 1
        group, self._queue = self._queue[:taken], self._queue[taken:]
        return group

    async def _drain(self) -> None:
        try:
            while self._queue:
                group = self._next_group()
                try:
                    seq = await self._write(merge([points for points, _ in group]))
                except asyncio.CancelledError:
                    self._queue[:0] = group  # failed below, with the rest
                    raise
                except Exception as exc:  # noqa: BLE001 - every request gets its own outcome below
                    await self._one_by_one(group, exc)
                    continue
                self.groups += 1
                self.requests += len(group)
                for _, future in group:
                    if not future.done():
                        future.set_result(seq)
        finally:
            self._drain_task = None
            for _, future in self._queue:  # cancelled while requests waited: they must not wait for ever
                if not future.done():
                    future.set_exception(RuntimeError("the write queue stopped"))
            self._queue.clear()

    async def _one_by_one(self, group: list[tuple[Points, asyncio.Future[int]]], exc: Exception) -> None:
        if len(group) == 1:
            if not group[0][1].done():
                group[0][1].set_exception(exc)
            return
        for points, future in group:
            try:
                seq = await self._write(points)
            except Exception as one:  # noqa: BLE001 - this request's own failure, given to it alone
                if not future.done():
                    future.set_exception(one)
            else:
                if not future.done():
                    future.set_result(seq)
