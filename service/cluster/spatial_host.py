"""One replica of one spatial partition: its share of every point layer and every polygon layer whole, resident in
the spatial engines as in one process. On Ray it runs as an actor (ray_layer.py).

Layers live in PostgreSQL; a host reads a layer again when its row id there changed (written again), which it
checks on every watch from the ingress and before a join that names versions it does not hold.
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
        self._lock = asyncio.Lock()

    async def start(self) -> dict[str, Any]:
        async with self._lock:
            if self.spatial is None:
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

                spatial.attach(CpuSpatialEngine())
                self.spatial = spatial
            await self._sync()
        return self.where()

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
                "started_at": self.started_at}

    async def point_in_polygon(self, versions: dict[str, int], points: str, polygons: str, mode: str, engine: str,
                               cursor: str | None, page_size: int) -> tuple[dict[str, Any], str]:
        """This partition's part of the join (its points against the whole polygon layer), for the layer versions
        the ingress sees; read again first if this host holds others."""
        if self.spatial is None or any(self.versions.get(n) != v for n, v in versions.items()):
            await self.start()
        if any(self.versions.get(n) != v for n, v in versions.items()):
            raise SpatialEngineNotReady(f"spatial partition {self.part} does not hold the layers' current versions")
        assert self.spatial is not None  # start() made it
        answer = await self.spatial.point_in_polygon(points, polygons, mode, engine, cursor, page_size)
        return answer.body, answer.engine
