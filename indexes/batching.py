"""Dynamic micro-batching: concurrent single-vector searches with the same key become one engine call.

While the engine works on one batch, new requests queue and go together as the next (up to max_batch), so a lone
client waits for nothing; with window_s > 0 an idle key's first request waits that long for company. Every future
is resolved, with the result or the engine's exception. A lone cheap query (`inline_below_s`) runs on the event
loop instead of hopping to a worker thread, unless `can_inline(key)` vetoes it; `try_inline(key, vector)` is the same
for a caller that cannot wait (service/http/express_protocol.py), within a budget of engine time per turn of the loop
(`turn_budget_s`). Why, with measurements: docs/design/vectors.md#micro-batching-and-inline-searches.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np

# run(key, queries (n, dim)) -> one result per query row, in order. The key is whatever the caller submits
# (Any: a run that takes its own kind of key, say a tuple, fits).
RunBatch = Callable[[Any, np.ndarray], list[Any]]


@dataclass
class _Lane:
    pending: list[tuple[np.ndarray, asyncio.Future]] = field(default_factory=list)
    busy: bool = False


class MicroBatcher:
    def __init__(self, run: RunBatch, executor: Executor, *, max_batch: int = 64, window_s: float = 0.0,
                 inline_below_s: float = 0.0, can_inline: Callable[[Any], bool] | None = None,
                 turn_budget_s: float = 0.003, learnt_keys: int = 1024) -> None:
        self.run = run
        self.executor = executor
        self.max_batch = max_batch
        self.window_s = window_s
        self.inline_below_s = inline_below_s if window_s <= 0 else 0.0
        self.can_inline = can_inline
        self._lanes: dict[Hashable, _Lane] = defaultdict(_Lane)
        self._lone_cost: dict[Hashable, float] = {}  # moving average of a lone query's engine time, per key ...
        self.learnt_keys = learnt_keys  # ... for at most this many keys, the oldest forgotten first
        self._arriving = 0  # searches between their arrival and the decision to inline them or not
        self.turn_budget_s = turn_budget_s
        self._this_turn = 0  # searches try_inline answered in this turn of the event loop ...
        self._turn_spent = 0.0  # ... and their engine time
        self.batches = 0
        self.queries = 0
        self.inline = 0

    def timed(self, key: Hashable, queries: np.ndarray,
              run: Callable[[np.ndarray], list[Any]] | None = None) -> list[Any]:
        """The key's search (`run`, or the batcher's own), its cost learnt when it is one query."""
        return self._timed(key, queries, run)[0]

    def _timed(self, key: Hashable, queries: np.ndarray,
               run: Callable[[np.ndarray], list[Any]] | None) -> tuple[list[Any], float]:
        """timed(), and the seconds the search took."""
        started = time.perf_counter()
        results = self.run(key, queries) if run is None else run(queries)
        seconds = time.perf_counter() - started
        if len(queries) == 1:
            learnt = self._lone_cost
            previous = learnt.get(key)
            if previous is None and len(learnt) >= self.learnt_keys:  # keys without end (filters): forget the oldest
                try:
                    del learnt[next(iter(learnt))]
                except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                    pass
            # Wall time: a search preempted on a busy machine (a worker thread among many client threads) reads as
            # many times its cost, and one such reading must not push the key off the event loop, where its
            # searches would only get slower. A real rise still shows within a dozen searches.
            learnt[key] = seconds if previous is None else 0.8 * previous + 0.2 * min(seconds, 2 * previous)
        return results, seconds

    def _inline_ok(self, key: Hashable) -> bool:
        lane = self._lanes.get(key)
        return (self._lone_cost.get(key, math.inf) < self.inline_below_s and (lane is None or not lane.busy)
                and (self.can_inline is None or self.can_inline(key)))

    def try_inline(self, key: Hashable, vector: np.ndarray,
                run: Callable[[np.ndarray], list[Any]] | None = None) -> Any | None:
        """The inline search, now, or None: not cheap enough, the key's lane is busy, another search is deciding,
        or it would take this turn of the loop past its budget (see the module's docstring). `run`: a search of
        the key's own (a filtered one, say) instead of the batcher's; its cost is learnt by timed()."""
        if not (self.inline_below_s and self._arriving == 0 and self._inline_ok(key)):
            return None
        if self._this_turn == 0:
            asyncio.get_running_loop().call_soon(self._new_turn)  # runs once this turn's callbacks are done
        elif self._turn_spent + self._lone_cost[key] > self.turn_budget_s:
            return None
        self._this_turn += 1
        results, seconds = self._timed(key, vector[None, :], run)
        self._turn_spent += seconds
        result = results[0]
        self.batches += 1
        self.queries += 1
        self.inline += 1
        return result

    def _new_turn(self) -> None:
        self._this_turn, self._turn_spent = 0, 0.0

    async def submit(self, key: Hashable, vector: np.ndarray) -> Any:
        if self.inline_below_s and self._inline_ok(key):
            self._arriving += 1
            try:
                await asyncio.sleep(0)  # requests that arrived with this one reach this point meanwhile
                alone = self._arriving == 1
            finally:
                self._arriving -= 1
            if alone and self._inline_ok(key):
                result = self.timed(key, vector[None, :])[0]
                self.batches += 1
                self.queries += 1
                self.inline += 1
                return result
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
                    results = await loop.run_in_executor(self.executor, self.timed, key, queries)
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
