"""recall@k of an engine, measured against exact search over the same stored vectors."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from .distance import exact_search_blocked, from_engine, prepare
from .errors import CollectionEmpty, InvalidInput
from .manager_search import Searches
from .vectors import check_batch, check_nonzero

# The most bytes of exact scores the ground truth holds at once (queries x rows x float32; exact_search's own
# temporaries make its peak a few times this), however many queries and rows there are.
SCORE_BLOCK_BYTES = 16 * 2**20


class Recall(Searches):
    """recall@k measurements, which run a search (hence over Searches)."""

    async def recall(self, name: str, k: int, engine: str, params: dict[str, Any] | None, sample: int,
                     queries: np.ndarray | None, seed: int, recall_target: float | None = None) -> dict[str, Any]:
        """recall@k of `engine` against exact search over the same stored vectors."""
        c = await self.collection(name)
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
        # Exact search over every row, in bounded blocks: seconds of CPU for large collections, so off the event loop.
        truth_scores, truth_rows = await asyncio.to_thread(exact_search_blocked, np, data,
                                                           prepare(np, queries, c.metric), k, c.metric,
                                                           SCORE_BLOCK_BYTES)
        # The same replica state the exact answer came from: no catch-up in between.
        answer = await self.search(name, queries, k, engine, params, consistency="eventually",
                                   recall_target=recall_target)
        truth_d = from_engine(np, truth_scores, c.metric)
        hits = 0
        for qi, got in enumerate(answer.result.ids):
            exact_ids = set(ids[truth_rows[qi][truth_rows[qi] >= 0]].tolist())
            kth = truth_d[qi][min(k, len(exact_ids)) - 1]
            # A returned id counts when it is a true neighbour, or ties the k-th true distance.
            for got_id, got_d in zip(got, answer.result.distances[qi]):
                if got_id in exact_ids or got_d <= kth + 1e-5 * max(1.0, abs(kth)):
                    hits += 1
        denominator = sum(min(k, len(ids)) for _ in range(len(queries)))
        return {"recall": hits / denominator, "k": k, "queries": len(queries), "engine": answer.engine,
                "fallback": answer.fallback, "params": params or {}, "search_ms": answer.took_ms,
                "plan": answer.result.plan}
