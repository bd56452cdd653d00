"""One replica of one spatial partition: its share of every point layer and every polygon layer whole, resident in
the spatial engines as in one process. On Ray it runs as an actor (ray_layer.py).

Layers live in PostgreSQL; a host reads a layer again when its row id there changed (written again), which it
checks on every watch from the ingress and before a join that names versions it does not hold.

A host reports ready only once its engines have compiled what a join needs (the GPU engine's warm_up; the CPU
engine's numba kernels, compiled by a join on a tiny layer, CpuSpatialEngine.warm_up) and it holds the current layers:
on a fresh machine the CPU kernels take 10-20 s to compile, which the first join must not pay.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

from service.admission.control import Admission
from service.cluster.shard_host import _ray_node
from service.database.postgres import open_pool
from service.process.devices import probe_cuda
from service.settings import Settings
from spatial.manager import SpatialEngineNotReady, SpatialManager
from spatial.partitions import partition_of

log = logging.getLogger("switchyard.cluster")


class SpatialHost:
    def __init__(self, dsn: str, data_dir: str, part: int, parts: int, replica: int,
                 settings: dict[str, Any] | None = None) -> None:
        self.dsn, self.part, self.parts, self.replica = dsn, part, parts, replica
        self.settings = Settings(**{"data_dir": data_dir, **(settings or {})})
        self.spatial: SpatialManager | None = None
        self.versions: dict[str, int] = {}  # layer name -> its PostgreSQL row id, as held here
        self.synced = False
        self.started_at = time.time()
        self.warm_s: float | None = None  # how long the engines' warm-up took, once done
        self.error: str | None = None  # why the last start failed (the next watch tries again)
        self._lock = asyncio.Lock()
        self._starting: asyncio.Task | None = None

    async def start(self) -> dict[str, Any]:
        """Start the engines and warm them up in the background (idempotent: the ingress asks every replica now
        and then, which is what starts one that Ray restarted); once warm, take in the layers' changes."""
        if self._kick().done() and self.spatial is not None:
            async with self._lock:
                await self._sync()
        return self.where()

    def _kick(self) -> asyncio.Task:
        if self._starting is None or (self._starting.done() and self._starting.exception() is not None):
            self._starting = asyncio.ensure_future(self._open())  # first call, or a retry after a failed start
        return self._starting

    async def _open(self) -> None:
        started = time.perf_counter()
        pool = None
        try:
            pool = await open_pool(self.dsn, min_size=1, max_size=2, init=None,
                                   command_timeout=self.settings.database.command_timeout_s)
            spatial = SpatialManager(pool, Admission(self.settings))
            if self.settings.gpu.mode != "off" and probe_cuda(enabled=True).present:
                from spatial.cuda_engine import CudaSpatialEngine

                try:  # compiled and proven before any request; a failure leaves this host on the CPU engine
                    await spatial.attach_warmed(CudaSpatialEngine())
                except Exception:  # noqa: BLE001
                    log.exception("cuda-spatial failed its warm-up: this host serves on the CPU")
            from spatial.cpu_engine import CpuSpatialEngine

            cpu = CpuSpatialEngine()
            spatial.attach(cpu)
            # On the engine's own thread, as its joins run: the actor answers where() meanwhile.
            await asyncio.get_running_loop().run_in_executor(spatial.executors[cpu.kind], cpu.warm_up)
        except Exception as exc:  # noqa: BLE001 - said by where(); the next watch tries again
            log.exception("spatial partition %d replica %d failed to start", self.part, self.replica)
            self.error = f"{type(exc).__name__}: {exc}"
            if pool is not None:
                await pool.close()
            raise
        self.warm_s, self.error = round(time.perf_counter() - started, 3), None
        self.spatial = spatial
        log.info("spatial partition %d replica %d warm in %.1f s", self.part, self.replica, self.warm_s)

    async def _sync(self) -> None:
        """Take in the layers written or dropped since the last look (the caller holds the lock)."""
        assert self.spatial is not None
        current = await self.spatial.store.versions()
        for name in [n for n in self.versions if n not in current]:
            self.spatial.forget(self.spatial.layers.pop(name, None))
            del self.versions[name]
        for name, version in current.items():
            if self.versions.get(name) != version:
                layer = partition_of(await self.spatial.store.load(name), self.part, self.parts)
                self.spatial.forget(self.spatial.layers.get(name))
                self.spatial.layers[name] = layer
                self.spatial.prepare(layer)  # the GPU engine uploads it now, not at its first join
                self.versions[name] = version
        self.synced = True

    def where(self) -> dict[str, Any]:
        engines = sorted(e.name for e in self.spatial.engines.values()) if self.spatial else []
        return {"partition": self.part, "partitions": self.parts, "replica": self.replica,
                "host": socket.gethostname(), "pid": os.getpid(), "node": _ray_node(),
                "engine": engines[0] if engines else None, "layers": dict(self.versions), "ready": self.synced,
                "warm_s": self.warm_s, "error": self.error, "started_at": self.started_at}

    async def point_in_polygon(self, versions: dict[str, int], points: str, polygons: str, mode: str, engine: str,
                               cursor: str | None, page_size: int) -> tuple[dict[str, Any], str]:
        """This partition's part of the join (its points against the whole polygon layer), for the layer versions
        the ingress sees; read again first if this host holds others."""
        if self.spatial is None:
            self._kick()
            raise SpatialEngineNotReady(f"spatial partition {self.part} replica {self.replica} is still warming up")
        if any(self.versions.get(n) != v for n, v in versions.items()):
            async with self._lock:
                await self._sync()
        if any(self.versions.get(n) != v for n, v in versions.items()):
            raise SpatialEngineNotReady(f"spatial partition {self.part} does not hold the layers' current versions")
        assert self.spatial is not None  # start() made it
        answer = await self.spatial.point_in_polygon(points, polygons, mode, engine, cursor, page_size)
        return answer.body, answer.engine
