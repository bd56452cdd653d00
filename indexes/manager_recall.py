"""recall@k of an engine, measured against exact search over the same stored vectors."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from .distance import exact_search, from_engine, prepare
from .errors import CollectionEmpty, InvalidInput
from .manager_search import Searches
from .manager_state import HEAVY_WORK
from .store import Collection
from .vectors import check_batch, check_nonzero


class Recall(Searches):
    """recall@k measurements, which run a search (hence over Searches)."""

    async def recall(self, name: str, k: int, engine: str, params: dict[str, Any] | None, sample: int,
                     queries: np.ndarray | None, seed: int, recall_target: float | None = None) -> dict[str, Any]:
        """recall@k of `engine` against exact search over the same stored vectors. Heavy work, all of it on the
        heavy executor's thread of lower CPU priority (HEAVY_WORK): the exact answer, and the engine's search."""
        heavy_work = HEAVY_WORK.set(True)
        try:
            # One at a time, as the heavy executor runs them: 20 at once all queued on its thread, each taking 20
            # times its own time, where the gate answers 503 with Retry-After past its queue.
            async with self.guard.slot("recall"):
                # As the other reads: a table dropped (here or by another process) while its rows are read is the
                # collection not found, or the one re-created under its name measured (_with_collection).
                return (await self._with_collection(name, lambda c: self._recall(
                    c, k, engine, params, sample, queries, seed, recall_target)))[1]
        finally:
            HEAVY_WORK.reset(heavy_work)

    async def _recall(self, c: Collection, k: int, engine: str, params: dict[str, Any] | None, sample: int,
                      queries: np.ndarray | None, seed: int, recall_target: float | None) -> dict[str, Any]:
        name = c.name
        if queries is not None:
            if queries.shape[1] != c.dim:
                raise InvalidInput(f"queries have dimension {queries.shape[1]}, the collection has {c.dim}",
                                   field="queries")
            check_nonzero(queries, c.metric, "queries")
            check_batch(len(queries), k, "queries")  # as a search would
        r = self.resident.get(name)
        if r is not None and r.loaded:
            ids, data = await r.run(r.index.live)
        else:
            ids, vectors = await self.store.rows(c)
            data = await asyncio.to_thread(prepare, np, vectors, c.metric)
        if len(ids) == 0:
            raise CollectionEmpty("the collection is empty: upsert points first", field="collection")
        if queries is None:
            check_batch(min(sample, len(ids)), k, "sample")
            rng = np.random.default_rng(seed)
            picked = rng.choice(len(ids), size=min(sample, len(ids)), replace=False)
            queries = data[np.sort(picked)]
        # Exact search over every row: seconds of CPU for large collections, so off the event loop, with the engines'
        # threads (the cores but the event loop's), not every core as a build takes: docs/design/serving.md.
        heavy = asyncio.get_running_loop().run_in_executor
        truth_scores, truth_rows = await heavy(self.heavy_executor, exact_search, np, data,
                                               prepare(np, queries, c.metric), k, c.metric, None, self.heavy_threads)
        # The same replica state the exact answer came from: no catch-up in between.
        answer = await self.search(name, queries, k, engine, params, consistency="eventually",
                                   recall_target=recall_target)
        hits = await heavy(self.heavy_executor, count_hits, ids[np.maximum(truth_rows, 0)], truth_rows >= 0,
                           from_engine(np, truth_scores, c.metric), answer.result.ids, answer.result.distances, k)
        denominator = len(queries) * min(k, len(ids))
        return {"recall": hits / denominator, "k": k, "queries": len(queries), "engine": answer.engine,
                "fallback": answer.fallback, "params": params or {}, "search_ms": answer.took_ms,
                "plan": answer.result.plan}


def count_hits(truth_ids: np.ndarray, truth_valid: np.ndarray, truth_d: np.ndarray, got_ids: list[list[int]],
               got_d: list[list[float]], k: int) -> int:
    """How many returned ids are true neighbours, or tie the k-th true distance (ties may be broken either way).
    Vectorised in chunks of queries, each converted from its lists on its own: a Python loop over every answer, or
    one conversion of them all, held the GIL for 5-100 ms per 10,000 queries, which every request waited on."""
    width = max(map(len, got_ids), default=0)
    if width == 0:
        return 0
    found = truth_valid.sum(axis=1)
    kth = truth_d[np.arange(len(truth_d)), np.maximum(np.minimum(k, found) - 1, 0)]
    hits = 0
    chunk = max(1, min(512, (1 << 22) // max(1, width * truth_ids.shape[1])))
    for q0 in range(0, len(got_ids), chunk):
        part = slice(q0, q0 + chunk)
        ids, dist, present = _padded(got_ids[part], got_d[part], width)
        ties = dist <= (kth[part] + 1e-5 * np.maximum(1.0, np.abs(kth[part])))[:, None]
        member = ((ids[:, :, None] == truth_ids[part, None, :]) & truth_valid[part, None, :]).any(axis=2)
        hits += int(((member | ties) & present).sum())
    return hits


def _padded(got_ids: list[list[int]], got_d: list[list[float]],
            width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Answers as (queries, width) arrays and where they hold one: some queries get fewer than k (a filter, a small
    collection)."""
    if all(len(row) == width for row in got_ids):
        ids, dist = np.asarray(got_ids, np.int64), np.asarray(got_d, np.float64)
        return ids, dist, np.ones(ids.shape, bool)
    ids, dist = np.zeros((len(got_ids), width), np.int64), np.zeros((len(got_ids), width), np.float64)
    present = np.zeros((len(got_ids), width), bool)
    for qi, (row_ids, row_d) in enumerate(zip(got_ids, got_d)):
        ids[qi, :len(row_ids)], dist[qi, :len(row_ids)], present[qi, :len(row_ids)] = row_ids, row_d, True
    return ids, dist, present
