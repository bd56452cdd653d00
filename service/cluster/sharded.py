"""Vector collections at an ingress whose resident indexes live in shard hosts elsewhere (a Ray cluster).

Everything PostgreSQL does stays as in one process: the catalog, writes (committed here, acknowledged once
committed), pgvector searches and fallbacks. What changes is the resident engine: a search goes to one replica
of every shard at once and their top-k lists merge exactly (indexes/shards.py); a write is followed by a nudge to
the replicas of the shards that own its ids (they follow the change log anyway, so a lost nudge only costs time).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np
import orjson

from indexes import pgvector_search
from indexes.errors import EngineUnavailable, InvalidInput, ShardUnavailable
from indexes.manager import CollectionManager, SearchAnswer
from indexes.resident import Changes, SearchResult
from indexes.shards import merge_results, shard_of
from indexes.store import Collection, Commit
from service.cluster.coalesce import Coalescer
from service.cluster.fanout import ShardSet, described
from service.cluster.parts import WatchesParts

log = logging.getLogger("switchyard.cluster")

NUDGE_WAIT_S = 1.0  # how long the nudge after a write waits for the owning replicas (it never holds the ack)


class ShardedCollections(WatchesParts, CollectionManager):
    part_label = "shard"

    def __init__(self, pool: asyncpg.Pool, data_dir: Path, shards: ShardSet, **kwargs: Any) -> None:
        super().__init__(pool, data_dir, **kwargs)
        self.parts = shards
        self.batches = Coalescer(self._run_coalesced, self.max_batch)

    def attach(self, kind: str, backend: Any) -> None:
        """No resident index lives in this process: the shard hosts hold them."""

    @property
    def ready(self) -> bool:
        """Every shard has a replica ready (as of the last watch)."""
        return self.loading is not None and self.loading.done() and self.parts.every_shard_up()

    def _serving_kind(self, r: Any) -> str | None:
        return self.parts.kind  # the engine the shard replicas said they serve with

    def _why_not(self, r: Any, engine: str) -> str:
        kind = self.parts.kind
        return f"the shards serve on the {kind} engine" if kind else "no shard replica has reported in yet"

    # -- searches ----------------------------------------------------------------------------------------
    async def search(self, name: str, queries: np.ndarray, k: int, engine: str = "auto",
                     params: dict[str, Any] | None = None, payload_filter: dict[str, Any] | None = None,
                     single: bool = False, consistency: str | None = None, seq: int | None = None,
                     recall_target: float | None = None) -> SearchAnswer:
        c, level, where = await self.check_search(name, queries, k, consistency, seq, params, payload_filter,
                                                  recall_target)
        order = self.engine_order(None, engine)
        fallback = None
        if order[0] != "pgvector":
            started = time.perf_counter()
            try:
                if single and len(queries) == 1:
                    # Same options, same fan-out: `session` seqs fold into the batch's highest (a stronger ask).
                    key = (name, k, orjson.dumps(params, option=orjson.OPT_SORT_KEYS),
                           orjson.dumps(payload_filter, option=orjson.OPT_SORT_KEYS), level, recall_target)
                    result, served = await self.batches.submit(key, queries[0], seq)
                else:
                    [result], served = await self._fan_out(c, queries, k, params, payload_filter, level, seq,
                                                           recall_target, split=False)
            except (InvalidInput, EngineUnavailable):
                raise
            except ShardUnavailable as exc:
                if engine != "auto":
                    raise
                fallback = f"{exc.detail}; served by pgvector"
            else:
                took = time.perf_counter() - started
                self.observe(self.engine_name(order[0]), "search", took, True)
                return SearchAnswer(result, served, round(took * 1000, 3))
        return await self._search(c, None, ["pgvector"], queries, k, engine, params, where, single, fallback,
                                  recall_target)

    async def _fan_out(self, c: Collection, queries: np.ndarray, k: int, params: dict[str, Any] | None,
                       payload_filter: dict[str, Any] | None, level: str, seq: int | None,
                       recall_target: float | None, split: bool) -> tuple[list[SearchResult], str]:
        """One search on one replica of every shard, merged; `split`: one result per query."""
        if level == "strong":
            # Fresh as of every request's arrival, on every machine: PostgreSQL's head now, not a host's clock.
            level, seq = "session", await self.store.head(c)
        parts = await self.parts.on_every_shard("search", c.name, queries, k, params, payload_filter, level, seq,
                                                recall_target)
        merged = merge_results([result for result, _ in parts], k)
        if not split:
            return [merged], parts[0][1]
        return [SearchResult([ids], [distances], merged.watermark, merged.plan)
                for ids, distances in zip(merged.ids, merged.distances)], parts[0][1]

    async def _run_coalesced(self, key: tuple, queries: np.ndarray, seq: int | None) -> list[tuple[SearchResult, str]]:
        name, k, params, payload_filter, level, recall_target = key
        c = await self.collection(name)
        results, served = await self._fan_out(c, queries, k, orjson.loads(params), orjson.loads(payload_filter), level,
                                              seq, recall_target, split=True)
        return [(result, served) for result in results]

    def search_inline(self, *args: Any, **kwargs: Any) -> None:
        """Every resident search here is a fan-out: nothing is answered on the event loop."""
        return None

    # -- writes ------------------------------------------------------------------------------------------
    async def _apply_own(self, c: Collection, commit: Commit, changes: Changes) -> None:
        ids = np.concatenate([changes.ids, changes.deleted])
        owners = sorted(set(shard_of(ids, self.parts.shards).tolist()))
        if owners:
            self._spawn(self._nudge(c.name, commit.seq, owners), f"nudging the shards of {c.name}")

    async def _nudge(self, name: str, seq: int, owners: list[int]) -> None:
        # Failures come back as values and are dropped: a replica that is down or slow catches up from the log.
        await self.parts.on_every_replica("catch_up", name, seq, shards=owners, timeout_s=NUDGE_WAIT_S)

    async def _build(self, c: Collection, progress: Any, fallback: str) -> dict[str, Any]:
        """Every replica rebuilds its part; pgvector's index (only the fallback here) follows in the background.
        (build() around it says so when the collection is dropped meanwhile.)"""
        name = c.name
        say = progress or (lambda done, total, message: None)
        say(0, None, f"rebuilding {self.parts.shards} shard(s) on every replica")
        answers = await self.parts.on_every_replica("build", name)
        out: dict[str, Any] = {"shards": [[described(a) for a in shard] for shard in answers]}
        if name not in self.fallback_builds and not await pgvector_search.has_index(self.pool, c):
            if fallback == "wait":
                say(0, None, "building the pgvector index")
                out["pgvector_index"] = await pgvector_search.build_index(self.pool, c, await self.store.count(c))
            else:
                out["pgvector_index"] = "building"
                self.fallback_builds.add(name)
                self._spawn(self._build_fallback(c), f"building the pgvector index of {name}")
        return out

    # -- reporting ---------------------------------------------------------------------------------------
    async def describe(self, name: str, verify: bool = False) -> dict[str, Any]:
        out = await super().describe(name, verify)
        if self.parts.kind:
            out["engines"] = [self.parts.kind, *out["engines"]]
        out["shards"] = await self.layout(name)
        return out

    async def layout(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every shard's replicas: where each runs and, for a collection, its index state there."""
        return await self.parts.layout("shard", "describe", name) if name else await super().layout()
