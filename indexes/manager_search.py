"""Searches: which engine serves (resident gpu/cpu, pgvector), the wait for a consistency level, the fallbacks under
`auto`, and the micro-batched or inline (search_inline) resident searches of single queries."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import asyncpg
import numpy as np

from . import filters, pgvector_search
from .ann import resolve_type, search_params
from .errors import CollectionNotFound, EngineFailed, EngineUnavailable, InvalidInput, NotCaughtUp
from .manager_state import ManagerState
from .replica import Replica, check_level
from .resident import ResidentCollection, SearchResult
from .store import Collection
from .vectors import MAX_K, check_nonzero

log = logging.getLogger("switchyard.vectors")



@dataclass
class SearchAnswer:
    result: SearchResult
    engine: str
    took_ms: float
    fallback: str | None = None


def check_target(recall_target: float | None, params: dict[str, Any] | None) -> None:
    if recall_target is None:
        return
    if params:
        raise InvalidInput("give either search params or a recall_target, not both", field="recall_target")
    if not 0 < recall_target <= 1:
        raise InvalidInput("must be above 0 and at most 1", field="recall_target")


def resident_params(index: ResidentCollection, configured: str,
                    params: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """`params` checked for the index type a resident search runs on: its index's, or where none is built yet,
    the type the collection's configured one (`configured`) resolves to at its size."""
    return search_params(index.index.config.index_type if index.index is not None else resolve_type(
        configured, index.count), params)


class Searches(ManagerState):
    """Searches, routed between the resident engines and pgvector."""

    def engine_order(self, r: Replica | None, engine: str) -> list[str]:
        resident_kind = self._serving_kind(r)
        if engine == "auto":
            return ([resident_kind] if resident_kind else []) + ["pgvector"]
        if engine == "pgvector":
            return ["pgvector"]
        if resident_kind == engine:
            return [engine]
        raise EngineUnavailable(f"engine {engine!r} cannot serve this collection: {self._why_not(r, engine)}",
                                field="engine")

    def _serving_kind(self, r: Replica | None) -> str | None:
        """The resident engine that serves the collection now ("cpu" or "gpu"), if any."""
        return self._kind_of(r) if r is not None and r.loaded else None

    def _why_not(self, r: Replica | None, engine: str) -> str:
        resident_kind = self._serving_kind(r)
        return (f"the collection is resident on the {resident_kind} engine" if resident_kind else
                "the collection's resident index is still loading" if r is not None and not r.loaded else
                f"no {engine} engine is available here")

    async def search(self, name: str, queries: np.ndarray, k: int, engine: str = "auto",
                     params: dict[str, Any] | None = None, payload_filter: dict[str, Any] | None = None,
                     single: bool = False, consistency: str | None = None, seq: int | None = None,
                     recall_target: float | None = None) -> SearchAnswer:
        """`payload_filter` is the filter language of indexes/filters.py; `recall_target` (instead of `params`)
        picks calibrated parameters on the resident engine (indexes/planner.py)."""
        arrived = time.monotonic()
        c, level, where = await self.check_search(name, queries, k, consistency, seq, params, payload_filter,
                                                  recall_target)
        r = self.resident.get(name)
        order = self.engine_order(r, engine)  # a resident engine in it only where there is a replica
        fallback = None
        if order[0] != "pgvector" and r is not None and not r.satisfies(level, seq, arrived, self.consistency.bound_s):
            try:
                async with asyncio.timeout(self.consistency.timeout_s):  # not wait_for: see indexes/follower.py
                    await r.reach(level, seq, arrived, self.consistency.bound_s)
            except CollectionNotFound:
                self._forget(name)
                raise
            except Exception as exc:  # noqa: BLE001 - the database is slow or gone: say so, or let pgvector answer
                reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                why = (f"the {self.engine_name(order[0])} replica could not reach consistency {level!r} within "
                       f"{self.consistency.timeout_s * 1000:.0f} ms ({reason})")
                if engine != "auto":
                    raise NotCaughtUp(why, field="consistency") from exc
                order, fallback = ["pgvector"], why + "; served by pgvector"
        return await self._search(c, r, order, queries, k, engine, params, where, single, fallback, recall_target)

    async def check_search(self, name: str, queries: np.ndarray, k: int, consistency: str | None, seq: int | None,
                           params: dict[str, Any] | None, payload_filter: dict[str, Any] | None,
                           recall_target: float | None) -> tuple[Collection, str, filters.Node | None]:
        """A search's 422s, before any engine sees it: the collection, the consistency level and the parsed filter."""
        c = await self.collection(name)
        level, where = self.check_query(c, queries, k, consistency, seq, params, payload_filter, recall_target)
        return c, level, where

    def check_query(self, c: Collection, queries: np.ndarray, k: int, consistency: str | None, seq: int | None,
                    params: dict[str, Any] | None, payload_filter: dict[str, Any] | None,
                    recall_target: float | None) -> tuple[str, filters.Node | None]:
        """A search's checks that need no engine, for `queries` (one vector, or a matrix) on `c`: shared by
        search(), which raises their 422s, and search_inline(), which leaves what they refuse to search(). Returns
        the consistency level to reach and the parsed filter."""
        level = consistency or self.consistency.default
        check_level(level, seq)
        where = filters.parse(payload_filter)
        check_target(recall_target, params)
        dim = queries.shape[-1]
        if dim != c.dim:
            raise InvalidInput(f"query has dimension {dim}, the collection has {c.dim}", field="vector")
        check_nonzero(queries.reshape(-1, dim), c.metric, "vector" if queries.size == dim else "vectors")
        if not 1 <= k <= MAX_K:
            raise InvalidInput(f"must be from 1 to {MAX_K}", field="k")
        return level, where

    def search_inline(self, name: str, query: np.ndarray, k: int, engine: str, params: dict[str, Any] | None,
                   consistency: str | None, seq: int | None, payload_filter: dict[str, Any] | None = None,
                   recall_target: float | None = None,
                   deliver: Callable[[SearchAnswer], None] | None = None) -> SearchAnswer | None:
        """One query answered at once on the event loop, or None: whatever would have to wait (a catch-up for the
        consistency level, an engine slot, the micro-batcher's thread), fail, or leave the resident engine goes
        through search(), which answers it or says why not. Searches are reads, so the caller may run the same
        request again there. `deliver`, if given, gets the answer as soon as it is found, before the slot and the
        metrics are seen to (its caller's client need not wait for them)."""
        arrived = time.monotonic()
        c, r = self.catalog.get(name), self.resident.get(name)
        if (c is None or r is None or not r.loaded or query.ndim != 1 or engine not in ("auto", "cpu")
                or self._kind_of(r) != "cpu"):
            return None
        served = self.engine_name("cpu")
        try:
            level, where = self.check_query(c, query, k, consistency, seq, params, payload_filter, recall_target)
            checked_items, run = resident_params(r.index, c.index_type, params), None
            if where is not None or recall_target is not None:
                key, run = self._planned(r, k, checked_items, where, recall_target)
            else:
                key = (name, k, checked_items)
        except InvalidInput:
            return None
        if (not r.satisfies(level, seq, arrived, self.consistency.bound_s) or self.guard.cooling(served)
                or not (slot := self.guard.try_slot(served))):
            return None
        started = time.perf_counter()
        try:
            found = self.batchers["cpu"].try_inline(key, query, run)
        except Exception:  # noqa: BLE001 - search() runs it again and reports the failure as usual
            found = None
        took = time.perf_counter() - started
        if found is None:
            slot.release(None)
            return None
        if run is None:
            ids, distances, watermark = found
            found = SearchResult([ids], [distances], watermark)
        answer = SearchAnswer(found, served, round(took * 1000, 3))
        try:
            if deliver is not None:
                deliver(answer)
        finally:
            slot.release(took)
            self.guard.succeeded(served)
            self.observe(served, "search", took, True)
        return answer

    async def _search(self, c: Collection, r: Replica | None, order: list[str], queries: np.ndarray, k: int,
                      engine: str, params: dict[str, Any] | None, where: filters.Node | None,
                      single: bool, fallback: str | None, recall_target: float | None) -> SearchAnswer:
        if engine == "auto" and order == ["pgvector"] and r is not None and fallback is None:
            fallback = (f"the resident index failed to load ({r.error})" if r.error
                        else "the resident index is still loading")
        for position, choice in enumerate(order):
            served = "pgvector" if choice == "pgvector" else self.engine_name(choice)
            last = position + 1 == len(order)
            if not last and (why := self.guard.cooling(served)):
                fallback = f"the {served} engine {why}; served by {order[position + 1]}"
                continue
            async with self.guard.slot(served):
                started = time.perf_counter()
                try:
                    if choice == "pgvector":
                        pg_params = pgvector_search.check_search_params(params if engine == "pgvector" else None)
                        result = await pgvector_search.search(self.pool, c, queries, k, pg_params, where)
                    else:
                        assert r is not None  # engine_order named a resident engine
                        result = await self._search_resident(r, queries, k, params, where, single, recall_target)
                except (InvalidInput, EngineUnavailable):
                    raise
                except asyncpg.UndefinedTableError:
                    raise self._vanished(c.name) from None
                except Exception as exc:  # noqa: BLE001 - an engine failure falls back under auto
                    self.observe(served, "search", time.perf_counter() - started, False)
                    self.guard.failed(served, exc)
                    if last:
                        raise EngineFailed(f"engine {choice} failed: {type(exc).__name__}: {exc}") from exc
                    # The exception's text goes to the log, under an id the answer carries: never to clients.
                    error_id = uuid.uuid4().hex[:16]
                    log.warning("engine %s failed on %s (error id %s), falling back to %s", choice, c.name, error_id,
                                order[position + 1], exc_info=exc)
                    fallback = f"the {served} engine failed (error id {error_id}); served by {order[position + 1]}"
                    continue
                took = time.perf_counter() - started
                self.guard.succeeded(served)
                self.observe(served, "search", took, True)
                return SearchAnswer(result, served, round(took * 1000, 3), fallback)
        raise EngineUnavailable("no engine can serve this collection", field="engine")

    async def _search_resident(self, r: Replica, queries: np.ndarray, k: int, params: dict[str, Any] | None,
                               where: filters.Node | None, single: bool, recall_target: float | None) -> SearchResult:
        index = r.index
        checked_items = resident_params(index, r.collection.index_type, params)
        checked = dict(checked_items)
        if where is not None or recall_target is not None:
            # The resident payload index evaluates the filter: no PostgreSQL query on this path.
            if single and len(queries) == 1:  # its cost learnt, so that search_inline may answer the next ones
                key, run = self._planned(r, k, checked_items, where, recall_target)
                return (await r.run(self.batchers[self._kind_of(r)].timed, key, queries, run))[0]
            return await r.run(index.search, queries, k, checked, where, recall_target)
        if single and len(queries) == 1:
            key = (r.collection.name, k, checked_items)
            ids, distances, watermark = await self.batchers[self._kind_of(r)].submit(key, queries[0])
            return SearchResult([ids], [distances], watermark)
        return await r.run(index.search, queries, k, checked, None)

    @staticmethod
    def _planned(r: Replica, k: int, checked_items: tuple, where: filters.Node | None,
                 recall_target: float | None) -> tuple[tuple, Callable[[np.ndarray], list[SearchResult]]]:
        """A filtered or recall-targeted search of one query: its micro-batcher key (for its cost) and the search.
        filters.key, not the tree, keys it: True == 1.0 in Python, but {"f": true} is no {"f": 1}."""
        index, checked = r.index, dict(checked_items)
        key = (r.collection.name, k, checked_items, where and filters.key(where), recall_target)
        return key, lambda queries: [index.search(queries, k, checked, where, recall_target)]

    def _run_batch(self, key: tuple, queries: np.ndarray) -> list[tuple[list[int], list[float], int | None]]:
        name, k, params = key
        r = self.resident.get(name)
        if r is None:
            raise CollectionNotFound(f"no collection named {name!r}", field="collection")
        result = r.index.search(queries, k, dict(params))
        return [(ids, d, result.watermark) for ids, d in zip(result.ids, result.distances)]

    def _uncontended(self, key: tuple) -> bool:
        r = self.resident.get(key[0])
        return r is not None and not r.index.lock.contended
