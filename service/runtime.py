"""What the service holds while it runs, and its start-up and shutdown order.

Start: PostgreSQL (the configured URL, or the embedded server) -> migrations -> pool -> engine probes ->
engines start in the background (so /healthz answers while they load) -> ready.
Stop: not ready -> engines stop -> pool closes -> embedded server stops.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Literal

import asyncpg

from indexes.distance import blas_threads
from indexes.manager import CollectionManager, Consistency
from indexes.resident import RebuildPolicy
from indexes.tasks import stop_tasks
from olap.manager import OlapManager
from service.admission.control import Admission
from service.admission.priority import lower_priority, lower_process_priority
from service.database.migrate import apply_migrations, load_migrations
from service.database.postgres import EmbeddedPostgres, connect, connect_kwargs, open_pool, server_facts
from service.database.supervisor import DatabaseSupervisor
from service.engines import EngineRegistry
from service.jobs import spool
from service.jobs.disk import open_ledger
from service.jobs.manager import JobRunner
from service.metrics import Metrics, ReplicationTrace
from service.process.devices import probe_cuda
from service.settings import Settings
from spatial.manager import SpatialManager

log = logging.getLogger("switchyard")
POOL_CLOSE_S = 10.0  # the most stop() waits for the pools to close gracefully

Phase = Literal["created", "starting", "running", "stopping", "stopped", "failed"]


def vector_options(settings: Settings) -> dict[str, Any]:
    """The CollectionManager options every process holding vector replicas takes from the settings."""
    v, r = settings.vectors, settings.replication
    return dict(max_batch=v.batch_max, batch_window_s=v.batch_window_ms / 1000, max_payload_keys=v.max_payload_keys,
                max_payload_value_bytes=v.max_payload_value_bytes, max_payload_row_bytes=v.max_payload_row_bytes,
                inline_search_s=settings.inline_search_s, inline_turn_s=v.inline_turn_us / 1e6,
                heavy_threads=settings.engine_threads, siblings=settings.replicas > 1,
                consistency=Consistency(r.consistency, r.bounded_staleness_ms / 1000, r.consistency_timeout_ms / 1000,
                                        r.poll_ms / 1000),
                policy=RebuildPolicy(dead_fraction=r.rebuild_dead_fraction, delta_rows=r.rebuild_delta_rows))

if TYPE_CHECKING:
    from service.pipeline import Pipeline


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self._switch_interval: float | None = None  # the process's GIL switch interval before start
        self.settings = settings
        self.metrics = Metrics()
        self.pipeline: Pipeline | None = None  # the request pipeline of hot calls, set by the app (http/app.py)
        self.registry = EngineRegistry(probe_cuda(enabled=settings.gpu.mode != "off"),
                                       gpu_memory_pool_mb=settings.gpu.memory_pool_mb)
        self.phase: Phase = "created"
        self.embedded: EmbeddedPostgres | None = None
        self.dsn: str | None = None
        self.pool: asyncpg.Pool | None = None
        self.sql_pool: asyncpg.Pool | None = None  # OLAP reads on PostgreSQL, apart from writes and readiness
        self.admission = Admission(settings, self.metrics)
        self.metrics.watch_gates(lambda: self.admission.gates, self.admission.classes, self.admission.loop_lag)
        self.database: DatabaseSupervisor | None = None
        self.vectors: CollectionManager | None = None
        self.jobs: JobRunner | None = None
        self.olap: OlapManager | None = None
        self.spatial: SpatialManager | None = None
        self.postgres_version: str | None = None
        self.latest_migration = max((m.version for m in load_migrations()), default=0)
        self._engines_task: asyncio.Task[None] | None = None
        self.trace: ReplicationTrace | None = None

    async def start(self) -> None:
        self.phase = "starting"
        try:
            s = self.settings
            spool.clear(s.data_dir)
            if s.database.url is None:
                self.embedded = EmbeddedPostgres(s.embedded_pgdata)
                self.dsn = await asyncio.to_thread(self.embedded.start)
            else:
                self.dsn = s.database.url
            conn = await connect(self.dsn, s.database.connect_timeout_s)
            try:
                applied = await apply_migrations(conn)
                self.postgres_version, extensions = await server_facts(conn)
            finally:
                await conn.close()
            if applied:
                log.info("applied %d migration(s): %s", len(applied),
                         ", ".join(f"{m.version:04d}_{m.name}" for m in applied))
            db = s.database
            self.pool = await open_pool(self.dsn, min_size=db.pool_min, max_size=db.pool_max,
                                        command_timeout=db.command_timeout_s, acquire_timeout_s=db.acquire_timeout_s)
            self.sql_pool = await open_pool(self.dsn, min_size=0, max_size=db.sql_pool_max, init=None,
                                            command_timeout=db.command_timeout_s,
                                            acquire_timeout_s=db.acquire_timeout_s)
            self.database = DatabaseSupervisor(
                self.pool, self.embedded, dsn=self.dsn, pool_connect_kwargs=connect_kwargs(db.command_timeout_s),
                metrics=self.metrics, interval_s=db.check_interval_s, probe_timeout_s=db.readiness_timeout_s,
                max_restarts=db.max_restarts, other_pools=(self.sql_pool,))
            self.database.start()
            self.registry.probe(self.postgres_version, extensions)
            disk = await open_ledger(s.data_dir, s.jobs.disk_reserve_mb * 2**20, s.jobs.ssb_quota_gb, self.pool)
            self.jobs = JobRunner(self.pool, disk, s.jobs.max_jobs, s.jobs.max_queued_jobs)
            if interrupted := await self.jobs.recover():
                log.warning("%d job(s) were interrupted by the last shutdown and are marked failed", interrupted)
            if s.replication.trace_dir is not None:
                self.trace = ReplicationTrace(s.replication.trace_dir)
            vector_kwargs: dict[str, Any] = dict(
                vector_options(s), dsn=self.dsn, on_applied=self._applied, guard=self.admission,
                thread_init=lower_priority,
                # The embedded PostgreSQL's processes are this host's and this user's: a background index build's
                # backend may be given a lower CPU priority (indexes/pgvector_search.build_index).
                lower_database_process=lower_process_priority if self.embedded is not None else None,
                observe=lambda engine, op, seconds, ok: self.metrics.observe("vectors", engine, op, seconds, ok),
            )
            if s.cluster.ray_address:
                from service.cluster.ray_layer import vector_shards
                from service.cluster.sharded import ShardedCollections

                shard_set = await vector_shards(s, self.dsn)
                self.vectors = ShardedCollections(self.pool, s.data_dir, shard_set, **vector_kwargs)
            else:
                self.vectors = CollectionManager(self.pool, s.data_dir, **vector_kwargs)
            observe_spatial = lambda engine, op, seconds, ok: self.metrics.observe("spatial", engine, op, seconds, ok)  # noqa: E731
            if s.cluster.ray_address and s.cluster.spatial_partitions:
                from service.cluster.partitioned_spatial import PartitionedSpatial
                from service.cluster.ray_layer import spatial_partitions

                self.spatial = PartitionedSpatial(self.pool, self.admission, await spatial_partitions(s, self.dsn),
                                                  observe=observe_spatial)
            else:
                self.spatial = SpatialManager(self.pool, self.admission, observe=observe_spatial,
                                              thread_init=lower_priority)
            observe_olap = lambda engine, op, seconds, ok: self.metrics.observe("olap", engine, op, seconds, ok)  # noqa: E731
            if s.cluster.ray_address and s.cluster.olap_partitions:
                from service.cluster.partitioned_olap import PartitionedOlap
                from service.cluster.ray_layer import olap_partitions

                self.olap = PartitionedOlap(s.data_dir, self.admission, await olap_partitions(s), observe=observe_olap)
            else:
                self.olap = OlapManager(s.data_dir, self.admission, observe=observe_olap, thread_init=lower_priority)
            self._engines_task = asyncio.create_task(self._start_engines(), name="switchyard-engines")
            self.phase = "running"
        except BaseException:
            self.phase = "failed"
            await self._release()
            raise

    def _applied(self, collection_id: int, seq: int, committed_at: float | None) -> None:
        """A replica here applied a commit: its lag (when the commit time is known) and the trace, if asked for."""
        now = time.time()
        if committed_at is not None:
            self.metrics.replication_lag.observe(max(0.0, now - committed_at))
        if self.trace is not None:
            self.trace.applied(collection_id, seq, now)

    async def _start_engines(self) -> None:
        await self.registry.start(pool=self.pool, sql_pool=self.sql_pool, data_dir=self.settings.data_dir,
                                  metrics=self.metrics,
                                  cpu_threads=self.settings.engine_threads, huge_pages=self.settings.cpu.huge_pages,
                                  gpu_build_process=self.settings.gpu.build_process,
                                  duckdb_memory_limit=self.settings.duckdb_memory,
                                  vectors=self.vectors, olap=self.olap, spatial=self.spatial)
        blas_threads(self.settings.engine_threads)  # after the engines are made: FAISS brings its own BLAS
        self._switch_interval = sys.getswitchinterval()  # the process's own, given back at stop
        sys.setswitchinterval(self.settings.cpu.gil_switch_us / 1e6)  # see docs/design/serving.md
        if self.vectors is not None:
            await self.vectors.start()
        if self.olap is not None:
            await self.olap.start()
        if self.spatial is not None:
            await self.spatial.start()
        for status in self.registry.list():
            labels = (status.spec.domain, status.spec.name, status.spec.kind)
            self.metrics.engine_available.labels(*labels).set(1 if status.available else 0)
            self.metrics.engine_ready.labels(*labels).set(1 if status.ready else 0)
        # What startup made (modules, the app, the engines) lives as long as the process: kept out of the cyclic
        # collector's passes, which walk every object they hold with the GIL held (see docs/design/serving.md).
        gc.collect()
        gc.freeze()
        self.admission.start(asyncio.get_running_loop())

    async def stop(self) -> None:
        self.phase = "stopping"
        self.admission.stop()
        await self._release()
        # What start() set for the process is given back (a process that starts another runtime: tests).
        gc.unfreeze()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
        self.phase = "stopped"

    async def _release(self) -> None:
        task, self._engines_task = self._engines_task, None
        await stop_tasks(task)
        if self.database is not None:
            await self.database.stop()  # no restarts of a server that is being stopped
        if self.jobs is not None:
            await self.jobs.stop()
            self.jobs = None
        if self.vectors is not None:
            await self.vectors.stop()  # writes snapshots of what changed
            self.vectors = None
        if self.trace is not None:
            self.trace.close()
            self.trace = None
        if self.olap is not None:
            await self.olap.stop()
            self.olap = None
        if self.spatial is not None:
            await self.spatial.stop()
            self.spatial = None
        await self.registry.stop()
        for pool in (self.sql_pool, self.pool):
            if pool is not None:
                try:  # a connection whose cancel request was never acknowledged would hold close() forever
                    await asyncio.wait_for(pool.close(), POOL_CLOSE_S)
                except TimeoutError:
                    log.warning("the PostgreSQL pool did not close within %g s; terminating its connections",
                                POOL_CLOSE_S)
                    pool.terminate()
        self.pool = self.sql_pool = self.database = None
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)
            self.embedded = None

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when the database answers, every migration is applied and the engines are loaded."""
        checks: dict[str, Any] = {"phase": self.phase}
        if self.phase != "running" or self.pool is None:
            return False, checks
        if self.database is not None and not self.database.up:
            checks["database"] = self.database.describe()
            checks["migrations"] = "unknown"
            checks["engines"] = "ok" if self.registry.ready else "loading"
            return False, checks
        try:
            async with asyncio.timeout(self.settings.database.readiness_timeout_s):
                applied = await self.pool.fetchval("SELECT coalesce(max(version), 0) FROM schema_migrations")
            checks["database"] = "ok"
            checks["migrations"] = ("ok" if applied >= self.latest_migration
                                    else f"at {applied}, need {self.latest_migration}")
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            checks["database"] = f"unreachable: {type(exc).__name__}"
            checks["migrations"] = "unknown"
        loading = self.registry.not_ready()
        if self.vectors is not None and self.registry.started and not self.vectors.ready:
            loading.append("vectors")  # on a cluster: a shard with no replica ready yet
        # On a cluster: SSB and spatial partitions with no replica ready yet (PartitionedOlap, PartitionedSpatial).
        parts_down = [name for name, manager in (("SSB partitions", self.olap), ("spatial partitions", self.spatial))
                      if not getattr(manager, "parts_ready", True)]
        if self.registry.started:
            loading += parts_down
        engines_ready = self.registry.ready and (self.vectors is None or self.vectors.ready) and not parts_down
        checks["engines"] = "ok" if engines_ready else (f"loading: {', '.join(loading)}" if loading else "starting")
        ok = checks["database"] == "ok" and checks["migrations"] == "ok" and checks["engines"] == "ok"
        return ok, checks
