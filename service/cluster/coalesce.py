"""Concurrent single-query searches with the same options share one fan-out to the shards.

A hop to a shard actor costs far more than the search of one more query there, so the ingress batches: the
first request of a kind goes at once, and those arriving while a fan-out of their kind is in flight leave
together in the next one (the shards micro-batch what reaches them too). No request waits for a timer.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Hashable

import numpy as np

# (options key, queries, the highest session seq asked by the batch) -> one answer per query, in order; the key is
# whatever the caller submits
Run = Callable[[Any, np.ndarray, int | None], Awaitable[list[Any]]]


class Coalescer:
    def __init__(self, run: Run, max_batch: int = 64) -> None:
        self._run, self.max_batch = run, max_batch
        self._waiting: dict[Hashable, list[tuple[np.ndarray, int | None, asyncio.Future]]] = {}
        self._flushing: dict[Hashable, asyncio.Task] = {}

    async def submit(self, key: Hashable, query: np.ndarray, seq: int | None) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append((query, seq, future))
        if key not in self._flushing:
            self._flushing[key] = asyncio.ensure_future(self._flush(key))
        return await future

    async def _flush(self, key: Hashable) -> None:
        try:
            while waiting := self._waiting.get(key):
                batch, self._waiting[key] = waiting[: self.max_batch], waiting[self.max_batch:]
                batch = [entry for entry in batch if not entry[2].cancelled()]
                if not batch:
                    continue
                seqs = [seq for _, seq, _ in batch if seq is not None]
                try:
                    answers = await self._run(key, np.stack([q for q, _, _ in batch]), max(seqs) if seqs else None)
                except Exception as exc:  # noqa: BLE001 - each request of the batch gets it
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, _, future), answer in zip(batch, answers):
                    if not future.done():
                        future.set_result(answer)
        finally:
            del self._flushing[key]
            if not self._waiting.get(key):
                self._waiting.pop(key, None)
