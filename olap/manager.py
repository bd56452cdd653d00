"""The OLAP domain's facade: SSB datasets on disk, the engines holding them, routing between engines.

A dataset is generated (or imported from ssb-dbgen .tbl files) to Parquet under <data_dir>/ssb/, then loaded
into every attached engine: DuckDB (cpu) and cuDF (gpu) keep it in memory, PostgreSQL as heap tables. The
active dataset is remembered in <data_dir>/ssb/active.json and loaded again at start-up.
Queries go to the engine asked for, or for `auto` to gpu -> cpu -> postgres, falling back on failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import sqlguard
from .errors import ClientError, UnrepresentableResult
from .queries import QUERIES
from .results import Result
from .schema import dataset_dir

log = logging.getLogger("switchyard.olap")

Progress = Callable[[int, int | None, str], None]
ORDER = ("gpu", "cpu", "postgres")
ENGINE_NAMES = {"gpu": "cudf", "cpu": "duckdb", "postgres": "postgres"}


class EngineNotReady(RuntimeError):
    """The engine asked for is absent here or has no dataset loaded."""


@dataclass
class Answer:
    result: Result
    engine: str
    took_ms: float
    fallback: str | None = None


class DatasetInUse(Exception):
    """The dataset asked to be deleted is the one the engines hold."""


class LoadStopped(Exception):
    """A dataset's load was stopped by its progress reporter (its job was cancelled)."""


class OlapManager:
    def __init__(self, data_dir: Path, guard: Any, observe: Callable[[str, str, float, bool], None] | None = None,
                 thread_init: Callable[[], None] | None = None) -> None:
        self.root = data_dir / "ssb"
        self.guard = guard  # admission control: slot(), cooling(), failed(), succeeded() (see indexes/manager.py)
        self.engines: dict[str, Any] = {}  # kind -> engine
        self.executors: dict[str, ThreadPoolExecutor] = {}
        # The SQL guard's parse and walk (olap/sqlguard.py), off the event loop: up to 38 ms of CPU a query. One
        # thread of its own (not an engine's, where it would queue behind running queries, and PostgreSQL has
        # none): it keeps one DuckDB parsing connection, and checks take turns instead of taking every core.
        self.guard_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="olap-sqlguard")
        self.observe = observe or (lambda engine, op, seconds, ok: None)
        self.thread_init = thread_init  # run by each engine thread as it starts (the service lowers its priority)
        self.active: Path | None = None
        self.loading: asyncio.Task | None = None
        self.load_errors: dict[str, str] = {}
        self._load_lock = asyncio.Lock()
        self._activations: set[asyncio.Task] = set()

    # -- engines ---------------------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        self.engines[engine.kind] = engine
        if engine.kind != "postgres":  # PostgreSQL is reached asynchronously; the others block a thread
            workers = 1 if engine.kind == "gpu" else 4
            self.executors[engine.kind] = ThreadPoolExecutor(max_workers=workers, initializer=self.thread_init,
                                                             thread_name_prefix=f"olap-{engine.kind}")

    @property
    def ready(self) -> bool:
        return self.loading is not None and self.loading.done()

    async def start(self, load_active: bool = True) -> None:
        """Load the dataset active.json names (in the background); `load_active=False`: the caller will say
        which dataset to activate (a partition host, told by its ingress)."""
        self.loading = asyncio.create_task(self._load_active() if load_active else asyncio.sleep(0))

    async def stop(self) -> None:
        if self.loading is not None and not self.loading.done():
            self.loading.cancel()
            await asyncio.gather(self.loading, return_exceptions=True)
        for engine in self.engines.values():
            close = getattr(engine, "close", None)
            if close is not None:
                close()
        for executor in (*self.executors.values(), self.guard_executor):
            executor.shutdown(wait=True)

    async def _load_active(self) -> None:
        marker = self.root / "active.json"
        if not marker.exists():
            return
        path = Path(json.loads(marker.read_text())["dataset"])
        if (path / "meta.json").exists():
            await self.activate(path)
        else:
            log.warning("the active SSB dataset %s is gone; generate or import one", path)

    # -- datasets --------------------------------------------------------------------------------------
    def datasets(self) -> list[dict[str, Any]]:
        out = []
        for meta_path in sorted(self.root.glob("*/meta.json")):
            if meta_path.parent.name.startswith("."):  # a generation or import still in progress
                continue
            meta = json.loads(meta_path.read_text())
            out.append({**meta, "path": str(meta_path.parent), "active": meta_path.parent == self.active})
        return out

    def dataset_path(self, name: str) -> Path | None:
        path = self.root / name
        return path if path.parent == self.root and (path / "meta.json").is_file() else None

    async def delete_dataset(self, name: str) -> None:
        """Remove a dataset from disk; the one the engines hold cannot be removed (DatasetInUse)."""
        path = self.dataset_path(name)
        if path is None:
            raise KeyError(name)
        async with self._load_lock:
            if self.active is not None and path.resolve() == self.active.resolve():
                raise DatasetInUse(f"dataset {name!r} is the one the engines hold; generate, import or activate "
                                   "another first")
            await asyncio.to_thread(shutil.rmtree, path)

    async def generate(self, scale_factor: float, seed: int, progress: Progress) -> dict[str, Any]:
        from .generate import generate

        target = dataset_dir(self.root.parent, scale_factor)
        if seed:
            target = target.with_name(f"{target.name}-seed{seed}")
        meta = await asyncio.to_thread(generate, scale_factor, target, seed, progress)
        loaded = await self.activate(target, progress)
        return {"dataset": str(target), "rows": meta["rows"], "engines": loaded}

    async def import_tbl(self, source: Path, name: str, expected_rows: dict[str, int] | None,
                         progress: Progress) -> dict[str, Any]:
        from .importer import import_tbl

        target = self.root / name
        meta = await asyncio.to_thread(import_tbl, source, target, expected_rows, progress)
        loaded = await self.activate(target, progress)
        return {"dataset": str(target), "rows": meta["rows"], "engines": loaded}

    async def activate(self, path: Path, progress: Progress | None = None) -> dict[str, Any]:
        """Load a dataset into every engine; an engine that fails keeps no dataset and says why. Every engine moves
        to `path` or none does: the load is a task of its own, which the caller's cancellation does not cut short,
        and a stop its progress reporter raises (a cancelled job's) loads back the dataset that was active. A job
        cancelled while PostgreSQL copied the tables once left DuckDB answering from the new dataset and
        PostgreSQL from the old."""
        task = asyncio.create_task(self._activate(path, progress))
        self._activations.add(task)  # a strong reference: it may outlive its caller
        task.add_done_callback(self._ended)
        try:
            return await asyncio.shield(task)
        except LoadStopped as stopped:
            raise (stopped.__cause__ or stopped) from None  # what the reporter raised: a job's JobCancelled

    def _ended(self, task: asyncio.Task) -> None:
        self._activations.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a load its cancelled caller no longer awaited is not an unread error

    async def _activate(self, path: Path, progress: Progress | None) -> dict[str, Any]:
        async with self._load_lock:
            previous, switched = self.active, list[str]()
            try:
                out = await self._load_into(path, progress, switched)
            except LoadStopped:
                if previous is not None and switched:
                    log.warning("loading %s was stopped after %s; loading %s back", path, switched, previous)
                    await self._load_into(previous, None, [])
                raise
            self.active = path
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / "active.json.tmp"
            tmp.write_text(json.dumps({"dataset": str(path)}))
            os.replace(tmp, self.root / "active.json")
            return out

    async def _load_into(self, path: Path, progress: Progress | None, switched: list[str]) -> dict[str, Any]:
        """`path` into each engine in ORDER, noting in `switched` those that took it; LoadStopped as soon as
        `progress` raises."""
        def say(done: int, total: int | None, message: str) -> None:
            if progress is not None:
                try:
                    progress(done, total, message)
                except Exception as exc:  # noqa: BLE001 - whatever the reporter raises stops the load
                    raise LoadStopped(str(exc)) from exc

        out: dict[str, Any] = {}
        for kind in ORDER:
            engine = self.engines.get(kind)
            if engine is None:
                continue
            say(0, None, f"loading the dataset into {engine.name}")
            try:
                if kind == "postgres":
                    out[engine.name] = await engine.load(path, say)
                else:
                    out[engine.name] = await asyncio.get_running_loop().run_in_executor(
                        self.executors[kind], engine.load, path)
                self.load_errors.pop(kind, None)
                switched.append(kind)
            except LoadStopped:
                raise
            except Exception as exc:  # noqa: BLE001 - one engine's failure leaves the others serving
                log.exception("loading %s into %s failed", path, engine.name)
                self.load_errors[kind] = f"{type(exc).__name__}: {exc}"
                out[engine.name] = {"error": self.load_errors[kind]}
        return out

    # -- queries ---------------------------------------------------------------------------------------
    def _order(self, engine: str) -> list[str]:
        if engine == "auto":
            order = [k for k in ORDER if k in self.engines and self.engines[k].ready]
            if not order:
                raise EngineNotReady("no engine has an SSB dataset loaded: generate or import one first")
            return order
        kind = {"cudf": "gpu", "duckdb": "cpu"}.get(engine, engine)
        if kind not in self.engines:
            raise EngineNotReady(f"engine {engine!r} is not available here")
        if not self.engines[kind].ready:
            why = self.load_errors.get(kind, "no SSB dataset is loaded (generate or import one)")
            raise EngineNotReady(f"engine {engine!r} is not ready: {why}")
        return [kind]

    async def _run(self, kind: str, method: str, *args: Any) -> Result:
        engine = self.engines[kind]
        if kind == "postgres":
            return await getattr(engine, method)(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executors[kind], getattr(engine, method), *args)

    async def _run_within(self, timeout_s: float, kind: str, method: str, *args: Any) -> Result:
        """_run, given up a second after the engines' own limit, which stops the query itself: a query that waited
        for the engine's thread, or an answer still being converted, is answered at that second all the same."""
        try:
            async with asyncio.timeout(timeout_s + 1):
                return await self._run(kind, method, *args)
        except TimeoutError as exc:
            if str(exc):  # the engine's own, which says what stopped
                raise
            raise TimeoutError(f"the query ran past its {timeout_s:g} s limit (timeout_s), counting its wait for the "
                               "engine and the conversion of its answer") from None

    async def _route(self, engine: str, method: str, operation: str, *args: Any, timeout_s: float | None = None,
                     client_errors: tuple[type[Exception], ...] = ()) -> Answer:
        """Run on the engine asked for, or under `auto` down ORDER. `client_errors` are the request's own fault for
        this operation: raised as they are, with no fallback and never counted against the engine (a client
        must not be able to put an engine into cool-down); any other exception is the engine failing."""
        order = self._order(engine)
        fallback = None
        expected: tuple[type[Exception], ...] = (TimeoutError, *client_errors)
        for position, kind in enumerate(order):
            name = ENGINE_NAMES[kind]
            last = position + 1 == len(order)
            if not last and (why := self.guard.cooling(name)):
                fallback = f"{name} {why}; served by {ENGINE_NAMES[order[position + 1]]}"
                continue
            async with self.guard.slot(name):
                started = time.perf_counter()
                try:
                    if timeout_s:
                        result = await self._run_within(timeout_s, kind, method, *args)
                    else:
                        result = await self._run(kind, method, *args)
                except expected:
                    self.observe(name, operation, time.perf_counter() - started, False)
                    raise
                except Exception as exc:  # noqa: BLE001 - an engine failure falls back under auto
                    self.observe(name, operation, time.perf_counter() - started, False)
                    self.guard.failed(name, exc)
                    if last:
                        raise
                    error_id = uuid.uuid4().hex[:16]  # the exception's text goes to the log only
                    log.warning("olap engine %s failed (error id %s), falling back", name, error_id, exc_info=exc)
                    fallback = f"{name} failed (error id {error_id}); served by {ENGINE_NAMES[order[position + 1]]}"
                    continue
                took = time.perf_counter() - started
                self.guard.succeeded(name)
                self.observe(name, operation, took, True)
                return Answer(result, name, round(took * 1000, 3), fallback)
        raise EngineNotReady("no engine could answer")

    async def run_query(self, query_id: str, params: dict[str, Any] | None, engine: str = "auto") -> Answer:
        from .queries import QueryParamError, render_sql

        if query_id not in QUERIES:
            raise KeyError(query_id)
        render_sql(query_id, params or {})  # validate parameters once, before any engine runs
        # The named queries' SQL is ours: an engine refusing it is the engine failing, bad parameters are not.
        return await self._route(engine, "run_query", "ssb_query", query_id, params or {},
                                 client_errors=(QueryParamError, UnrepresentableResult))

    async def run_sql(self, sql: str, engine: str, max_rows: int, timeout_s: float) -> Answer:
        checked = await asyncio.get_running_loop().run_in_executor(self.guard_executor, sqlguard.check, sql)
        return await self._route(engine, "run_sql", "sql", checked, max_rows, timeout_s, timeout_s=timeout_s,
                                 client_errors=(ClientError,))
