"""Dynamic micro-batching: concurrent single-vector searches with the same key become one engine call.

While the engine works on one batch, new requests queue; when it finishes, everything queued (up to
max_batch) goes as the next batch. A lone client therefore waits for nothing, and 32 concurrent clients
share calls of ~32 vectors. With window_s > 0 the first request of an idle key also waits up to that long
for company. Every future is resolved, with the result or with the engine's exception.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np

# run(key, queries (n, dim)) -> one result per query row, in order.
RunBatch = Callable[[Hashable, np.ndarray], list[Any]]


@dataclass
class _Lane:
    pending: list[tuple[np.ndarray, asyncio.Future]] = field(default_factory=list)
    busy: bool = False


class MicroBatcher:
    def __init__(self, run: RunBatch, executor: Executor, *, max_batch: int = 64, window_s: float = 0.0) -> None:
        self.run = run
        self.executor = executor
        self.max_batch = max_batch
        self.window_s = window_s
        self._lanes: dict[Hashable, _Lane] = defaultdict(_Lane)
        self.batches = 0
        self.queries = 0

    async def submit(self, key: Hashable, vector: np.ndarray) -> Any:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        lane = self._lanes[key]
        lane.pending.append((vector, future))
        if not lane.busy:
            lane.busy = True
            asyncio.get_running_loop().create_task(self._drain(key, lane))
        return await future

    async def _drain(self, key: Hashable, lane: _Lane) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.window_s > 0 and len(lane.pending) < self.max_batch:
                await asyncio.sleep(self.window_s)
            while lane.pending:
                batch, lane.pending = lane.pending[: self.max_batch], lane.pending[self.max_batch:]
                live = [(v, f) for v, f in batch if not f.cancelled()]
                if not live:
                    continue
                queries = np.stack([v for v, _ in live])
                try:
                    results = await loop.run_in_executor(self.executor, self.run, key, queries)
                except Exception as exc:  # noqa: BLE001 - handed to every waiting request
                    for _, f in live:
                        if not f.done():
                            f.set_exception(exc)
                    continue
                self.batches += 1
                self.queries += len(live)
                for (_, f), result in zip(live, results):
                    if not f.done():
                        f.set_result(result)
        finally:
            lane.busy = False
            if not lane.pending:
                self._lanes.pop(key, None)
            else:  # arrived while we were finishing: keep draining
                lane.busy = True
                loop.create_task(self._drain(key, lane))
