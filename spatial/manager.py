"""The spatial domain's facade: layers (PostgreSQL, resident as GeoArrow-style buffers), joins, routing.

Joins run on the engine asked for, or for `auto` gpu -> cpu -> postgis, falling back on failure. Pair outputs
are paged with a cursor (the next point position): each page's points are counted first and only the leading
whole points whose pairs fit page_size pairs are written (geoarrow.pairs_prefix), so no request allocates more
than a page of pairs (or one point's, if it alone has more). An engine with `takes_cancel` (the CPU one) gets a
threading.Event set when the caller gives up (its deadline passed), and stops at its next chunk of points.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import orjson

from .geoarrow import GeometryError
from .layers import Layer
from .store import LayerNotFound, SpatialStore

log = logging.getLogger("switchyard.spatial")

ORDER = ("gpu", "cpu", "postgis")
MAX_PAGE = 100_000


class SpatialEngineNotReady(RuntimeError):
    """The engine asked for is not available here."""


@dataclass
class JoinAnswer:
    body: dict[str, Any]
    engine: str
    took_ms: float
    fallback: str | None = None


def encode_cursor(position: int) -> str:
    return base64.urlsafe_b64encode(orjson.dumps({"p": position})).decode()


def decode_cursor(cursor: str | None, points: int) -> int:
    """The point position a page starts at, from the cursor of the page before it (None: the first page), on a
    layer of `points` points now: a cursor past its end (the layer was replaced by a smaller one) is refused."""
    if cursor is None:
        return 0
    try:
        position = orjson.loads(base64.urlsafe_b64decode(cursor.encode()))["p"]
    except (ValueError, KeyError, TypeError, orjson.JSONDecodeError):
        raise GeometryError("is not a cursor this service gave out", field="cursor") from None
    if type(position) is not int or position < 0:
        raise GeometryError("is not a cursor this service gave out", field="cursor")
    if position >= points:
        raise GeometryError(f"points past the layer's end (it holds {points} points now): start again without a "
                            "cursor", field="cursor")
    return position


def _prepare(engine: Any, layer: Layer) -> None:
    try:
        engine.prepare(layer.geometry)
    except Exception:  # noqa: BLE001 - the layer is committed; its first join tries again (or falls back)
        log.warning("spatial engine %s could not prepare layer %r", engine.name, layer.name, exc_info=True)


class SpatialManager:
    def __init__(self, pool: Any, guard: Any, observe: Callable[[str, str, float, bool], None] | None = None,
                 thread_init: Callable[[], None] | None = None) -> None:
        self.store = SpatialStore(pool)
        self.guard = guard  # admission control: slot(), cooling(), failed(), succeeded() (see indexes/manager.py)
        self.layers: dict[str, Layer] = {}
        self.engines: dict[str, Any] = {}
        self.executors: dict[str, ThreadPoolExecutor] = {}
        self.observe = observe or (lambda engine, op, seconds, ok: None)
        self.thread_init = thread_init  # run by each engine thread as it starts (the service lowers its priority)
        self.loading: asyncio.Task | None = None

    def attach(self, engine: Any) -> None:
        self.engines[engine.kind] = engine
        if engine.kind != "postgis":
            self.executors[engine.kind] = ThreadPoolExecutor(max_workers=1, initializer=self.thread_init,
                                                             thread_name_prefix=f"spatial-{engine.kind}")

    async def attach_warmed(self, engine: Any) -> None:
        """Attach an engine and run its warm_up on the thread that will serve it (per-thread device state
        included); if the warm-up fails the engine is detached and the error raised."""
        self.attach(engine)
        try:
            await asyncio.get_running_loop().run_in_executor(self.executors[engine.kind], engine.warm_up)
        except BaseException:
            self.engines.pop(engine.kind, None)
            executor = self.executors.pop(engine.kind, None)
            if executor is not None:
                executor.shutdown(wait=False)
            raise

    @property
    def ready(self) -> bool:
        return self.loading is not None and self.loading.done()

    async def start(self) -> None:
        self.loading = asyncio.create_task(self._load_all())

    async def stop(self) -> None:
        if self.loading is not None and not self.loading.done():
            self.loading.cancel()
            await asyncio.gather(self.loading, return_exceptions=True)
        for executor in self.executors.values():
            executor.shutdown(wait=True)

    async def _load_all(self) -> None:
        """Every stored layer, made resident in the engines before the manager reports ready."""
        pending: list[Future] = []
        for name in await self.store.names():
            self.layers[name] = await self.store.load(name)
            pending += self.prepare(self.layers[name])
        await asyncio.gather(*map(asyncio.wrap_future, pending))

    # -- layers ----------------------------------------------------------------------------------------
    async def create(self, layer: Layer) -> Layer:
        await self.store.save(layer)
        self.forget(self.layers.get(layer.name))
        self.layers[layer.name] = layer
        self.prepare(layer)  # not awaited: a join queues behind it on the engine's thread
        return layer

    async def drop(self, name: str) -> None:
        await self.store.drop(name)
        self.forget(self.layers.pop(name, None))

    def forget(self, old: Layer | None) -> None:
        """A rewritten or dropped layer's resident structures go (on the GPU, its device buffers), each in its
        engine's own thread: an engine is only ever called from there."""
        if old is None:
            return
        for kind, engine in self.engines.items():
            if kind in self.executors and hasattr(engine, "forget"):
                self.executors[kind].submit(engine.forget, old.geometry)

    def prepare(self, layer: Layer) -> list[Future]:
        """What a new layer's first join would pay, done now in each engine's own thread (engines with `prepare`:
        the GPU one uploads it and builds its structures, the CPU one compiles its kernels once). A failure is
        logged; the join then does it itself."""
        return [self.executors[kind].submit(_prepare, engine, layer) for kind, engine in self.engines.items()
                if kind in self.executors and hasattr(engine, "prepare")]

    def layer(self, name: str, kind: str, field: str) -> Layer:
        layer = self.layers.get(name)
        if layer is None:
            raise LayerNotFound(f"no layer named {name!r}", field)
        if layer.kind != kind:
            raise GeometryError(f"layer {name!r} holds {layer.kind}, not {kind}", field=field)
        return layer

    # -- routing ---------------------------------------------------------------------------------------
    def _order(self, engine: str) -> list[str]:
        if engine == "auto":
            order = [k for k in ORDER if k in self.engines]
            if not order:
                raise SpatialEngineNotReady("no spatial engine is available here")
            return order
        kind = {"cuda-spatial": "gpu", "cpu-spatial": "cpu"}.get(engine, engine)
        if kind not in self.engines:
            raise SpatialEngineNotReady(f"engine {engine!r} is not available here")
        return [kind]

    async def _run(self, engine: str, operation: str, method: str, args: tuple,
                   by_name: tuple) -> tuple[Any, str, float, str | None]:
        """Run `method` on the engines in routing order: resident engines get the buffers (`args`), PostGIS the
        layer names (`by_name`), since its copies of the layers live in the database."""
        order = self._order(engine)
        fallback = None
        for position, kind in enumerate(order):
            impl = self.engines[kind]
            last = position + 1 == len(order)
            if not last and (why := self.guard.cooling(impl.name)):
                fallback = f"{impl.name} {why}; served by {self.engines[order[position + 1]].name}"
                continue
            async with self.guard.slot(impl.name):
                started = time.perf_counter()
                try:
                    fn = getattr(impl, method)
                    if kind == "postgis":
                        result = await fn(*by_name)
                    else:
                        result = await self._in_thread(kind, impl, fn, args)
                except GeometryError:
                    raise
                except Exception as exc:  # noqa: BLE001 - an engine failure falls back under auto
                    self.observe(impl.name, operation, time.perf_counter() - started, False)
                    self.guard.failed(impl.name, exc)
                    if last:
                        raise
                    error_id = uuid.uuid4().hex[:16]  # the exception's text goes to the log only
                    log.warning("spatial engine %s failed (error id %s), falling back", impl.name, error_id,
                                exc_info=exc)
                    fallback = (f"{impl.name} failed (error id {error_id}); served by "
                                f"{self.engines[order[position + 1]].name}")
                    continue
                took = time.perf_counter() - started
                self.guard.succeeded(impl.name)
                self.observe(impl.name, operation, took, True)
                return result, impl.name, round(took * 1000, 3), fallback
        raise SpatialEngineNotReady("no spatial engine could answer")

    async def _in_thread(self, kind: str, impl: Any, fn: Callable, args: tuple) -> Any:
        """fn(*args) on the engine's thread. The thread cannot be interrupted: when this await ends early (the
        request's deadline cancelled it) an engine that takes `cancel` is told to stop at its next chunk of points,
        so the next join does not wait behind one nobody reads."""
        cancel = threading.Event()
        call = functools.partial(fn, *args, cancel=cancel) if getattr(impl, "takes_cancel", False) else \
            functools.partial(fn, *args)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executors[kind], call)
        finally:
            cancel.set()  # after an answer: nothing left to stop

    # -- joins -----------------------------------------------------------------------------------------
    async def point_in_polygon(self, points: str, polygons: str, mode: str, engine: str, cursor: str | None,
                               page_size: int) -> JoinAnswer:
        pts = self.layer(points, "points", "points")
        polys = self.layer(polygons, "polygons", "polygons")
        if mode == "counts":
            counts, name, took, fallback = await self._run(engine, "pip_counts", "pip_counts",
                                                           (pts.geometry, polys.geometry), (points, polygons))
            return JoinAnswer({"polygon_ids": polys.ids.tolist(), "counts": np.asarray(counts).tolist(),
                               "points": len(pts), "matched": int(np.asarray(counts).sum())}, name, took, fallback)
        start = decode_cursor(cursor, len(pts))
        stop = min(len(pts), start + page_size)
        # As within_distance: the engines count each point's pairs and write only the points that fit page_size.
        (first, second, next_start), name, took, fallback = await self._run(
            engine, "pip_pairs", "pip_pairs_page", (pts.geometry, polys.geometry, start, stop, page_size),
            (points, polygons, start, stop, page_size))
        pairs = np.column_stack([pts.ids[np.asarray(first)], polys.ids[np.asarray(second)]])
        return JoinAnswer({"pairs": pairs.tolist(),
                           "next_cursor": encode_cursor(next_start) if next_start < len(pts) else None},
                          name, took, fallback)

    async def within_distance(self, left: str, right: str, radius_m: float, engine: str, cursor: str | None,
                              page_size: int) -> JoinAnswer:
        a = self.layer(left, "points", "left")
        b = self.layer(right, "points", "right")
        self_join = left == right
        start = decode_cursor(cursor, len(a))
        stop = min(len(a), start + page_size)
        # At most page_size pairs (or one point's, if it alone has more) are ever computed: the engines count
        # each point's pairs first and write only the points that fit.
        (i, j, d, next_start), name, took, fallback = await self._run(
            engine, "within_distance", "within_distance_page",
            (a.geometry, b.geometry, radius_m, start, stop, self_join, page_size),
            (left, right, radius_m, start, stop, self_join, page_size))
        i, j, d = np.asarray(i), np.asarray(j), np.asarray(d)
        body = {"pairs": np.column_stack([a.ids[i], b.ids[j]]).tolist(),
                "distances_m": d.tolist(),
                "next_cursor": encode_cursor(next_start) if next_start < len(a) else None}
        return JoinAnswer(body, name, took, fallback)
