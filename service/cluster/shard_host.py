"""One replica of one vector shard: the resident indexes of the ids that hash to the shard, for every collection.

A host is an ordinary object with async methods; on Ray it runs as an actor (service/cluster/ray_layer.py), and
the tests can also run it in-process. It opens its own PostgreSQL pool and follows the change log like any other
replica (LISTEN/NOTIFY, a poll as backstop), keeping only its shard's rows (indexes/shards.py), so a host that was
killed and restarted replays what it missed from PostgreSQL: no write reaches it any other way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Awaitable

import numpy as np

from indexes.engines import CuvsEngine, FaissEngine
from indexes.errors import CollectionNotFound, EngineUnavailable
from indexes.manager import CollectionManager
from indexes.resident import SearchResult
from indexes.shards import Shard
from service.admission.control import Admission
from service.database.postgres import open_pool
from service.process.devices import probe_cuda
from service.process.link import EngineServer, frame_limit
from service.process.messages import CatchUp, Failure, Reply, Request, ShardAnswer, ShardSearch
from service.runtime import vector_options
from service.settings import Settings

log = logging.getLogger("switchyard.cluster")


class ShardHost:
    def __init__(self, dsn: str, data_dir: str, shard: int, shards: int, replica: int,
                 settings: dict[str, Any] | None = None) -> None:
        self.dsn, self.shard, self.replica = dsn, Shard(shard, shards), replica
        # Each replica keeps its own snapshots: two replicas of a shard may share a machine.
        self.data_dir = Path(data_dir) / "shards" / f"{shard}-of-{shards}" / f"replica-{replica}"
        self.settings = Settings(**{"data_dir": data_dir, **(settings or {})})
        self.vectors: CollectionManager | None = None
        self.kind: str | None = None
        self.started_at = time.time()
        self._starting: asyncio.Task | None = None
        self._direct: EngineServer | None = None
        self.data_address: str | None = None  # host:port of the direct search channel, once listening
        # Its frames are signed with this key, which only callers through the placing layer learn (start()).
        self.channel_key = secrets.token_bytes(32)

    # -- life cycle ------------------------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Open the pool and start loading (idempotent: the ingress asks every replica now and then, which is
        what starts one that Ray restarted; loading goes on after it returns)."""
        await asyncio.shield(self._kick())
        return {**self.where(), "channel_key": self.channel_key.hex()}

    def _kick(self) -> asyncio.Future:
        if self._starting is None or (self._starting.done() and self._starting.exception() is not None):
            self._starting = asyncio.ensure_future(self._start())  # first call, or a retry after a failed start
        return self._starting

    async def _start(self) -> None:
        s = self.settings
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pool = await open_pool(self.dsn, min_size=1, max_size=4, command_timeout=s.database.command_timeout_s,
                               acquire_timeout_s=s.database.acquire_timeout_s)
        vectors = CollectionManager(pool, self.data_dir, dsn=self.dsn, guard=Admission(s), shard=self.shard,
                                    **vector_options(s))
        gpu = s.gpu.mode != "off" and probe_cuda(enabled=True).present
        engine = (CuvsEngine if gpu else FaissEngine)(vectors, cpu_threads=s.cpu.threads, huge_pages=s.cpu.huge_pages,
                                                       gpu_build_process=s.gpu.build_process)
        await engine.start()
        self.kind = vectors.resident_kind
        await vectors.start()
        self.vectors = vectors
        # Searches and write nudges skip the placing layer's call path (a Ray call cost the ingress 1-1.5 ms of CPU,
        # measured): typed frames over TCP, as between a front and the engine process (service/process/link.py).
        host = _node_ip()
        self._direct = EngineServer((host, 0), {ShardSearch: self._direct_search, CatchUp: self._direct_catch_up},
                                    key=self.channel_key, max_frame=frame_limit(s.server.max_body_bytes))
        await self._direct.start()
        self.data_address = f"{host}:{self._direct.port}"

    async def stop(self) -> None:
        if self._direct is not None:
            await self._direct.stop()
        if self.vectors is not None:
            pool = self.vectors.pool
            await self.vectors.stop()
            await pool.close()
            self.vectors = None

    def where(self) -> dict[str, Any]:
        return {"shard": self.shard.index, "shards": self.shard.count, "replica": self.replica,
                "host": socket.gethostname(), "pid": os.getpid(), "node": _ray_node(), "engine": self.kind,
                "ready": self.ready(), "data": self.data_address, "started_at": self.started_at}

    def ready(self) -> bool:
        """Started, and every collection it held at its start loaded. A collection created since loads on its own:
        calls for it wait for that load (_knows) while the others are served."""
        return self.vectors is not None and self.vectors.loading is not None and self.vectors.loading.done()

    def _manager(self) -> CollectionManager:
        self._kick()
        if not self.ready():
            raise EngineUnavailable(f"shard {self.shard} replica {self.replica} is still loading", field="engine")
        assert self.vectors is not None
        return self.vectors

    # -- the calls an ingress makes ----------------------------------------------------------------------
    async def search(self, name: str, queries: np.ndarray, k: int, params: dict[str, Any] | None,
                     payload_filter: dict[str, Any] | None, consistency: str | None, seq: int | None,
                     recall_target: float | None) -> tuple[SearchResult, str]:
        """This shard's top k on its resident engine, never PostgreSQL's (that would search every shard's
        rows): if it cannot serve, the ingress asks another replica of the shard."""
        vectors = self._manager()
        await self._knows(name)
        answer = await vectors.search(name, queries, k, self.kind or "cpu", params, payload_filter,
                                      single=len(queries) == 1, consistency=consistency, seq=seq,
                                      recall_target=recall_target)
        return answer.result, answer.engine

    async def _direct_search(self, request: Request) -> Reply:
        c = request.call
        assert isinstance(c, ShardSearch)  # the channel's handler for this type
        return await _replied(request, self.search(c.collection, c.matrix(), c.k, c.params, c.filter, c.consistency,
                                                   c.seq, c.recall_target))

    async def _direct_catch_up(self, request: Request) -> Reply:
        c = request.call
        assert isinstance(c, CatchUp)
        return await _replied(request, self.catch_up(c.collection, c.seq))

    async def catch_up(self, name: str, seq: int) -> int:
        """Apply the log up to at least `seq` (a write the ingress just committed); returns the watermark."""
        vectors = self._manager()
        await self._knows(name)
        r = vectors.resident[name]
        await r.reach("session", seq, time.monotonic(), vectors.consistency.bound_s)
        return r.watermark

    async def build(self, name: str) -> dict[str, Any]:
        vectors = self._manager()
        await self._knows(name)
        return await vectors.rebuild_resident(name)

    async def describe(self, name: str) -> dict[str, Any]:
        out = self.where()
        if self.vectors is not None:
            r = self.vectors.resident.get(name)
            out["index_state"] = r.state() if r is not None else None
        return out

    async def _knows(self, name: str) -> None:
        """Return once this host's replica of the collection is loaded. One created a moment ago may not have
        reached the host's catalog yet (read now), or may still be loading: waited for as long as the ingress waits
        for a call, then EngineUnavailable (the ingress asks another replica)."""
        vectors = self.vectors
        assert vectors is not None
        if name not in vectors.resident:
            await vectors.sync_catalog_now()
        if name in vectors.resident and await vectors.wait_loaded(name, self.settings.cluster.shard_call_timeout_s):
            return
        r = vectors.resident.get(name)
        if r is None:  # unknown, or dropped while it loaded
            raise CollectionNotFound(f"no collection named {name!r}", field="collection")
        why = f"could not load it ({r.error})" if r.error else "is still loading it"
        raise EngineUnavailable(f"shard {self.shard} replica {self.replica} {why}", field="engine")


async def _replied(request: Request, answer: Awaitable[Any]) -> Reply:
    """A direct-channel reply: the answer, or the failure (a domain error as it is, anything else as EngineFailed
    with its text)."""
    try:
        value = await answer
    except Exception as exc:  # noqa: BLE001 - sent back, never raised here
        return Reply(request.id, value=Failure.of(exc))
    if isinstance(value, tuple):  # a search's (SearchResult, engine)
        result, engine = value
        value = ShardAnswer(result.ids, result.distances, result.watermark, result.plan, engine)
    return Reply(request.id, value=value)


def _node_ip() -> str:
    """The address other machines reach this host at: Ray's idea of this node, else loopback (in-process)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def _ray_node() -> str | None:
    """The Ray node this host runs on, when it runs as a Ray actor."""
    import sys

    ray = sys.modules.get("ray")  # never imported here: only a Ray worker has it loaded
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()
