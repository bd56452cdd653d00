"""The vector domain's facade: collections in Postgres, their resident indexes, routing between engines.

Write path: validate -> Postgres transaction (serialised per collection) -> resident index updated -> ack.
Read path: pick an engine (gpu -> cpu -> pgvector for `auto`) -> search resident data -> response says
which engine served and why it fell back, if it did.
Start-up: each collection's snapshot is loaded and the changes after it replayed from Postgres; without a
usable snapshot the index is rebuilt from Postgres.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import asyncpg
import numpy as np

from . import pgvector_search, snapshots
from .ann import INDEX_TYPES, check_params, resolve_type
from .batching import MicroBatcher
from .distance import METRICS, exact_search, from_engine, prepare
from .errors import EngineFailed, EngineUnavailable, InvalidInput
from .resident import IndexBackend, ResidentCollection, SearchResult
from .store import Collection, CollectionStore
from .vectors import Points

log = logging.getLogger("switchyard.vectors")

MAX_K = 1000
ENGINE_KIND = {"gpu": "cuvs", "cpu": "faiss"}
Progress = Callable[[int, int | None, str], None]


@dataclass
class Resident:
    collection: Collection
    index: ResidentCollection
    loaded: bool = False
    error: str | None = None
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    rebuild_task: asyncio.Task | None = None
    saved: tuple | None = None  # (watermark, rows, index type) of the last snapshot written
    bulk_loading: int = 0  # bulk loads in progress: they build once at the end, so no background rebuilds
    loaded_from: str | None = None  # "snapshot" (+ replay) or "postgres" (rebuilt), said by GET collection


@dataclass
class SearchAnswer:
    result: SearchResult
    engine: str
    took_ms: float
    fallback: str | None = None


class CollectionManager:
    def __init__(self, pool: asyncpg.Pool, data_dir: Path, *, max_batch: int = 64, batch_window_s: float = 0.0,
                 observe: Callable[[str, str, float, bool], None] | None = None) -> None:
        self.store = CollectionStore(pool)
        self.pool = pool
        self.snapshot_dir = data_dir / "vectors"
        self.backends: dict[str, IndexBackend] = {}  # "gpu"/"cpu" -> backend that keeps indexes resident
        self.executors: dict[str, ThreadPoolExecutor] = {}
        self.resident: dict[str, Resident] = {}
        self.max_batch, self.batch_window_s = max_batch, batch_window_s
        self.batchers: dict[str, MicroBatcher] = {}
        self.observe = observe or (lambda engine, op, seconds, ok: None)
        self.loading: asyncio.Task | None = None
        self.catalog: dict[str, Collection] = {}  # collection definitions never change, so they are cached

    # -- engines ---------------------------------------------------------------------------------------
    def attach(self, kind: str, backend: IndexBackend) -> None:
        """Make a backend hold resident indexes. cuVS calls must come from one thread (NVIDIA/cuvs #2041)."""
        self.backends[kind] = backend
        self.executors[kind] = ThreadPoolExecutor(max_workers=1 if kind == "gpu" else 2,
                                                  thread_name_prefix=f"vectors-{kind}")
        self.batchers[kind] = MicroBatcher(self._run_batch, self.executors[kind], max_batch=self.max_batch,
                                           window_s=self.batch_window_s)

    @property
    def resident_kind(self) -> str | None:
        """Where new resident indexes live: the GPU when there is one, else the CPU."""
        return "gpu" if "gpu" in self.backends else "cpu" if "cpu" in self.backends else None

    @property
    def ready(self) -> bool:
        return self.loading is not None and self.loading.done() and all(r.loaded or r.error for r in self.resident.values())

    async def start(self) -> None:
        self.loading = asyncio.create_task(self._load_all())

    async def stop(self) -> None:
        if self.loading is not None and not self.loading.done():
            self.loading.cancel()
            await asyncio.gather(self.loading, return_exceptions=True)
        for r in list(self.resident.values()):
            if r.rebuild_task is not None and not r.rebuild_task.done():
                r.rebuild_task.cancel()
                await asyncio.gather(r.rebuild_task, return_exceptions=True)
        await self.save_snapshots()
        for executor in self.executors.values():
            executor.shutdown(wait=True)

    # -- collections -----------------------------------------------------------------------------------
    async def collection(self, name: str) -> Collection:
        """The collection's definition, from memory after the first lookup (no database round trip)."""
        c = self.catalog.get(name)
        if c is None:
            c = self.catalog[name] = await self.store.get(name)
        return c

    async def create(self, name: str, dim: int, metric: str, index_type: str, index_params: dict[str, Any] | None,
                     pgvector_index: dict[str, Any] | None) -> Collection:
        if metric not in METRICS:
            raise InvalidInput(f"must be one of {', '.join(METRICS)}", field="metric")
        if index_type not in INDEX_TYPES:
            raise InvalidInput(f"must be one of {', '.join(INDEX_TYPES)}", field="index.type")
        params = check_params("build", index_type, index_params, "index.params")
        pg_index = pgvector_search.check_index(pgvector_index)
        c = await self.store.create(name, dim, metric, index_type, params, pg_index)
        self.catalog[name] = c
        if self.resident_kind is not None:
            self.resident[name] = Resident(c, self._new_index(c), loaded=True)
        return c

    async def drop(self, name: str) -> None:
        c = await self.collection(name)
        self.catalog.pop(name, None)
        r = self.resident.pop(name, None)
        if r is not None and r.rebuild_task is not None:
            r.rebuild_task.cancel()
        await self.store.drop(name)
        for kind in ENGINE_KIND.values():
            snapshots.remove(snapshots.path_for(self.snapshot_dir, c.id, kind))

    async def describe(self, name: str) -> dict[str, Any]:
        c = await self.collection(name)
        r = self.resident.get(name)
        engines = ["pgvector"]
        state: dict[str, Any] = {"resident": False}
        if r is not None:
            engines.insert(0, r.index.backend.name)
            idx = r.index.index
            state = {
                "resident": True, "loaded": r.loaded, "error": r.error, "engine": r.index.backend.name,
                "index_type": idx.config.index_type if idx is not None else None,
                "indexed_rows": r.index.indexed_rows, "delta_rows": r.index.delta_rows,
                "dead_rows": r.index.n_dead, "watermark": r.index.watermark,
                "rebuilding": r.rebuild_task is not None and not r.rebuild_task.done(),
                "loaded_from": r.loaded_from,
            }
        state["pgvector_index"] = await pgvector_search.has_index(self.pool, c)
        return {"collection": c, "count": await self.store.count(c), "engines": engines, "index_state": state}

    def _new_index(self, c: Collection) -> ResidentCollection:
        kind = self.resident_kind
        assert kind is not None
        return ResidentCollection(c.name, c.dim, c.metric, c.index_type, c.index_params, self.backends[kind])

    def _kind_of(self, r: Resident) -> str:
        return r.index.backend.kind

    # -- writes ----------------------------------------------------------------------------------------
    async def upsert(self, name: str, points: Points) -> int:
        """Returns the change sequence of the write; acknowledged data is committed in Postgres."""
        c = await self.collection(name)
        if points.vectors.shape[1] != c.dim:
            raise InvalidInput(f"vectors have dimension {points.vectors.shape[1]}, the collection has {c.dim}",
                               field="vectors")
        r = self.resident.get(name)
        if r is None:
            return await self.store.upsert(c, points)
        async with r.write_lock:
            seq = await self.store.upsert(c, points)
            await self._in_executor(r, r.index.upsert, points.ids, points.vectors, seq)
        self._maybe_rebuild(r)
        return seq

    async def delete(self, name: str, ids: np.ndarray) -> int:
        c = await self.collection(name)
        r = self.resident.get(name)
        if r is None:
            gone, _ = await self.store.delete(c, ids)
            return len(gone)
        async with r.write_lock:
            gone, seq = await self.store.delete(c, ids)
            await self._in_executor(r, r.index.delete, gone, seq)
        self._maybe_rebuild(r)
        return len(gone)

    async def bulk_upsert(self, name: str, points: Points, progress: Progress, chunk: int = 20_000) -> dict[str, Any]:
        """A large load in committed chunks (each chunk acknowledged once committed), then index builds."""
        total = len(points.ids)
        done = 0
        r = self.resident.get(name)
        if r is not None:
            r.bulk_loading += 1
        try:
            for start in range(0, total, chunk):
                end = min(total, start + chunk)
                payloads = points.payloads[start:end] if points.payloads is not None else None
                await self.upsert(name, Points(points.ids[start:end], points.vectors[start:end], payloads))
                done = end
                progress(done, total, f"stored {done} of {total} points")
        finally:
            if r is not None:
                r.bulk_loading -= 1
        built = await self.build(name, lambda _done, _total, message: progress(done, total, message))
        return {"upserted": done, **built}

    async def build(self, name: str, progress: Progress | None = None) -> dict[str, Any]:
        """Compact and rebuild the resident index, and create the pgvector index if it is missing."""
        c = await self.collection(name)
        r = self.resident.get(name)
        say = progress or (lambda done, total, message: None)
        out: dict[str, Any] = {}
        if r is not None:
            started = time.perf_counter()
            await self._rebuild(r, lambda message: say(0, None, message))
            out["resident_build_s"] = round(time.perf_counter() - started, 3)
            out["resident_index"] = r.index.index.config.index_type if r.index.index is not None else None
            await self._save_snapshot(r)
        if not await pgvector_search.has_index(self.pool, c):
            say(0, None, "building the pgvector index")
            started = time.perf_counter()
            out["pgvector_index"] = await pgvector_search.build_index(self.pool, c, await self.store.count(c))
            out["pgvector_build_s"] = round(time.perf_counter() - started, 3)
        return out

    async def _rebuild(self, r: Resident, say: Callable[[str], None]) -> None:
        current = asyncio.current_task()
        if r.rebuild_task is not None and r.rebuild_task is not current and not r.rebuild_task.done():
            await asyncio.gather(r.rebuild_task, return_exceptions=True)
        await self._in_executor(r, r.index.rebuild, say)

    def _maybe_rebuild(self, r: Resident) -> None:
        if r.bulk_loading:
            return
        if (r.rebuild_task is None or r.rebuild_task.done()) and r.index.needs_rebuild():
            async def background() -> None:
                await self._in_executor(r, r.index.rebuild, None)
                await self._save_snapshot(r)
            r.rebuild_task = asyncio.create_task(background(), name=f"rebuild-{r.collection.name}")

    # -- reads -----------------------------------------------------------------------------------------
    def engine_order(self, r: Resident | None, engine: str) -> list[str]:
        resident_kind = self._kind_of(r) if r is not None and r.loaded else None
        if engine == "auto":
            return ([resident_kind] if resident_kind else []) + ["pgvector"]
        if engine == "pgvector":
            return ["pgvector"]
        if resident_kind == engine:
            return [engine]
        why = (f"the collection is resident on the {resident_kind} engine" if resident_kind else
               "the collection's resident index is still loading" if r is not None and not r.loaded else
               f"no {engine} engine is available here")
        raise EngineUnavailable(f"engine {engine!r} cannot serve this collection: {why}", field="engine")

    async def search(self, name: str, queries: np.ndarray, k: int, engine: str = "auto",
                     params: dict[str, Any] | None = None, payload_filter: dict[str, Any] | None = None,
                     single: bool = False) -> SearchAnswer:
        c = await self.collection(name)
        if queries.shape[1] != c.dim:
            raise InvalidInput(f"query has dimension {queries.shape[1]}, the collection has {c.dim}", field="vector")
        if not 1 <= k <= MAX_K:
            raise InvalidInput(f"must be from 1 to {MAX_K}", field="k")
        r = self.resident.get(name)
        order = self.engine_order(r, engine)
        return await self._search(c, r, order, queries, k, engine, params, payload_filter, single)

    async def _search(self, c: Collection, r: Resident | None, order: list[str], queries: np.ndarray, k: int,
                      engine: str, params: dict[str, Any] | None, payload_filter: dict[str, Any] | None,
                      single: bool) -> SearchAnswer:
        fallback = None
        if engine == "auto" and order == ["pgvector"] and r is not None:
            fallback = (f"the resident index failed to load ({r.error})" if r.error
                        else "the resident index is still loading")
        for position, choice in enumerate(order):
            served = "pgvector" if choice == "pgvector" else ENGINE_KIND[choice]
            started = time.perf_counter()
            try:
                if choice == "pgvector":
                    pg_params = pgvector_search.check_search_params(params if engine == "pgvector" else None)
                    result = await pgvector_search.search(self.pool, c, queries, k, pg_params, payload_filter)
                else:
                    result = await self._search_resident(r, queries, k, params, payload_filter, single)
            except (InvalidInput, EngineUnavailable):
                raise
            except Exception as exc:  # noqa: BLE001 - an engine failure falls back under auto
                self.observe(served, "search", time.perf_counter() - started, False)
                if position + 1 == len(order):
                    raise EngineFailed(f"engine {choice} failed: {type(exc).__name__}: {exc}") from exc
                log.warning("engine %s failed on %s, falling back: %s", choice, c.name, exc)
                fallback = f"{choice} failed ({type(exc).__name__}: {exc}); served by {order[position + 1]}"
                continue
            took = time.perf_counter() - started
            self.observe(served, "search", took, True)
            return SearchAnswer(result, served, round(took * 1000, 3), fallback)
        raise EngineUnavailable("no engine can serve this collection", field="engine")

    async def _search_resident(self, r: Resident, queries: np.ndarray, k: int, params: dict[str, Any] | None,
                               payload_filter: dict[str, Any] | None, single: bool) -> SearchResult:
        index_type = r.index.index.config.index_type if r.index.index is not None else resolve_type(
            r.collection.index_type, r.index.count)
        checked = check_params("search", index_type, params, "params")
        kind = self._kind_of(r)
        if payload_filter:
            allowed = await self.store.ids_matching(r.collection, payload_filter)
            return await self._in_executor(r, r.index.search, queries, k, checked, allowed)
        if single and len(queries) == 1:
            key = (r.collection.name, k, tuple(sorted(checked.items())))
            ids, distances = await self.batchers[kind].submit(key, queries[0])
            return SearchResult([ids], [distances])
        return await self._in_executor(r, r.index.search, queries, k, checked, None)

    def _run_batch(self, key: tuple, queries: np.ndarray) -> list[tuple[list[int], list[float]]]:
        name, k, params = key
        r = self.resident[name]
        result = r.index.search(queries, k, dict(params))
        return list(zip(result.ids, result.distances))

    async def _in_executor(self, r: Resident, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executors[self._kind_of(r)], fn, *args)

    # -- recall ----------------------------------------------------------------------------------------
    async def recall(self, name: str, k: int, engine: str, params: dict[str, Any] | None, sample: int,
                     queries: np.ndarray | None, seed: int) -> dict[str, Any]:
        """recall@k of `engine` against exact search over the same stored vectors."""
        c = await self.collection(name)
        r = self.resident.get(name)
        if r is not None and r.loaded:
            ids, data = await self._in_executor(r, r.index.live)
        else:
            ids, _, vectors = await self.store.rows_since(c, 0)
            data = prepare(np, vectors, c.metric)
        if len(ids) == 0:
            raise InvalidInput("the collection is empty", field="collection")
        if queries is None:
            rng = np.random.default_rng(seed)
            picked = rng.choice(len(ids), size=min(sample, len(ids)), replace=False)
            queries = data[np.sort(picked)]
        if queries.shape[1] != c.dim:
            raise InvalidInput(f"queries have dimension {queries.shape[1]}, the collection has {c.dim}", field="queries")
        truth_scores, truth_rows = exact_search(np, data, prepare(np, queries, c.metric), k, c.metric)
        answer = await self.search(name, queries, k, engine, params)
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
                "fallback": answer.fallback, "params": params or {}, "search_ms": answer.took_ms}

    # -- start-up and snapshots ------------------------------------------------------------------------
    async def _load_all(self) -> None:
        if self.resident_kind is None:
            return
        for c in await self.store.list():
            self.catalog[c.name] = c
            r = Resident(c, self._new_index(c))
            self.resident[c.name] = r
        for r in list(self.resident.values()):
            try:
                await self._load(r)
                r.loaded = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one broken collection must not stop the others
                log.exception("loading collection %s failed; pgvector serves it", r.collection.name)
                r.error = f"{type(exc).__name__}: {exc}"

    def _snapshot_meta(self, r: Resident) -> dict[str, Any]:
        c = r.collection
        return {"collection_id": c.id, "name": c.name, "dim": c.dim, "metric": c.metric,
                "configured_type": c.index_type, "params": c.index_params, "engine": r.index.backend.name}

    async def _load(self, r: Resident) -> None:
        c = r.collection
        started = time.perf_counter()
        path = snapshots.path_for(self.snapshot_dir, c.id, r.index.backend.name)
        state = await asyncio.to_thread(snapshots.load, path, self._snapshot_meta(r))
        async with r.write_lock:
            if state is not None:
                await self._in_executor(r, r.index.restore, state)
                gone, _ = await self.store.deleted_since(c, r.index.watermark)
                r.index.delete(gone, None)
            ids, seqs, vectors = await self.store.rows_since(c, r.index.watermark)
            if len(ids):
                await self._in_executor(r, r.index.upsert, ids, vectors, int(seqs.max()))
            r.index.watermark = max(r.index.watermark, await self.store.latest_seq(c))
            count = await self.store.count(c)
            if r.index.count != count:  # a snapshot that disagrees with Postgres is not trusted
                log.warning("collection %s: resident count %d != stored %d; rebuilding from Postgres",
                            c.name, r.index.count, count)
                r.index = self._new_index(c)
                ids, seqs, vectors = await self.store.rows_since(c, 0)
                await self._in_executor(r, r.index.upsert, ids, vectors, int(seqs.max()) if len(seqs) else 0)
                state = None
            if state is None or r.index.needs_rebuild():
                await self._in_executor(r, r.index.rebuild, None)
        r.loaded_from = "snapshot" if state is not None else "postgres"
        log.info("collection %s: %d vectors resident on %s in %.2f s (from %s)", c.name, r.index.count,
                 r.index.backend.name, time.perf_counter() - started, r.loaded_from)
        if state is None:
            await self._save_snapshot(r)

    async def _save_snapshot(self, r: Resident) -> None:
        if r.collection.name not in self.resident:
            return
        state = await self._in_executor(r, r.index.state)
        mark = (state["watermark"], len(state["ids"]), state["index_type"])
        if mark == r.saved:
            return  # nothing changed since the last snapshot
        path = snapshots.path_for(self.snapshot_dir, r.collection.id, r.index.backend.name)
        await asyncio.to_thread(snapshots.save, path, state, self._snapshot_meta(r))
        r.saved = mark

    async def save_snapshots(self) -> None:
        for r in list(self.resident.values()):
            if r.loaded:
                try:
                    await self._save_snapshot(r)
                except Exception:  # noqa: BLE001
                    log.exception("snapshot of %s failed (Postgres still holds every point)", r.collection.name)

