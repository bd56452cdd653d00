"""One replica of one SSB partition: the dimension tables and its share of lineorder, held by the in-memory OLAP
engines (DuckDB, and cuDF on a GPU) as in one process. On Ray it runs as an actor (ray_layer.py).

The ingress says which dataset is active with every watch call (`start`); a replica that holds another one, or
none (it was just started or restarted by Ray), writes its partition of the new one and loads it meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from olap.manager import EngineNotReady, OlapManager
from olap.partitions import write_partition
from olap.results import Result
from service.admission.control import Admission
from service.cluster.shard_host import _ray_node
from service.process.devices import probe_cuda
from service.settings import Settings

log = logging.getLogger("switchyard.cluster")


class OlapHost:
    def __init__(self, data_dir: str, part: int, parts: int, replica: int,
                 settings: dict[str, Any] | None = None) -> None:
        self.part, self.parts, self.replica = part, parts, replica
        self.root = Path(data_dir) / "partitions" / f"olap-{part}-of-{parts}" / f"replica-{replica}"
        self.settings = Settings(**{"data_dir": data_dir, **(settings or {})})
        self.olap: OlapManager | None = None
        self.wanted: str | None = None  # the dataset the ingress holds active
        self.loaded: str | None = None  # the dataset whose partition the engines hold
        self.error: str | None = None
        self.started_at = time.time()
        self._loading: asyncio.Task | None = None

    async def start(self, dataset: str | None) -> dict[str, Any]:
        if self.olap is None:
            s = self.settings
            self.olap = OlapManager(self.root, Admission(s))
            if s.gpu.mode != "off" and probe_cuda(enabled=True).present:
                from olap.cudf_engine import CudfEngine

                self.olap.attach(CudfEngine())
            from olap.duckdb_engine import DuckDBEngine

            self.olap.attach(DuckDBEngine(threads=s.cpu.threads, memory_limit=s.duckdb_memory))
            await self.olap.start(load_active=False)  # the ingress names the dataset on every watch
        if dataset is not None and dataset != self.wanted:
            self.wanted, self.error = dataset, None
            self._loading = asyncio.ensure_future(self._load(Path(dataset)))
        return self.where()

    async def _load(self, dataset: Path) -> None:
        assert self.olap is not None
        try:
            partition = await asyncio.to_thread(write_partition, dataset, self.part, self.parts)
            loaded = await self.olap.activate(partition)
            errors = {name: r["error"] for name, r in loaded.items() if isinstance(r, dict) and "error" in r}
            if errors and len(errors) == len(loaded):
                raise RuntimeError(f"no engine loaded partition {self.part}: {errors}")
            if str(dataset) == self.wanted:
                self.loaded = str(dataset)
        except Exception as exc:  # noqa: BLE001 - said by where(); the next watch with another dataset retries
            log.exception("loading partition %d of %s failed", self.part, dataset)
            self.error = f"{type(exc).__name__}: {exc}"

    def where(self) -> dict[str, Any]:
        engines = sorted(e.name for e in self.olap.engines.values() if e.ready) if self.olap else []
        return {"partition": self.part, "partitions": self.parts, "replica": self.replica,
                "host": socket.gethostname(), "pid": os.getpid(), "node": _ray_node(),
                "engine": engines[0] if engines else None, "dataset": self.loaded,
                # Its engines started and hold the dataset the ingress has active (none yet: nothing to hold).
                "ready": self.olap is not None and self.loaded == self.wanted, "error": self.error,
                "started_at": self.started_at}

    async def run_query(self, dataset: str, query_id: str, params: dict[str, Any]) -> tuple[Result, str]:
        """This partition's answer to an SSB query (a partial aggregate), on its fastest engine."""
        if self.olap is None or self.loaded != dataset:
            raise EngineNotReady(f"partition {self.part} replica {self.replica} does not hold {dataset} yet")
        answer = await self.olap.run_query(query_id, params, "auto")
        return answer.result, answer.engine
