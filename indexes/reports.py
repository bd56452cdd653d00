"""Every process's word on its replica of a collection, gathered through PostgreSQL: the asking process notifies
`r:<collection id>:<request>` on the change channel, each follower writes its report to vector_replica_reports
under that request, and the asker waits (briefly) for as many as there are listening processes."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from typing import Any

from .follower import APPLICATION_PREFIX, Follower
from .replica import Replica
from .store import Collection, CollectionStore


async def report(store: CollectionStore, follower: Follower, c: Collection, r: Replica | None,
                 shard: str | None = None) -> dict[str, Any]:
    """This process's replica of `c`: rows, watermark, content digest, lag behind PostgreSQL, rebuilds. A shard's
    replica says which shard it holds (its rows and digest are that shard's, not the collection's)."""
    out: dict[str, Any] = {"process": follower.process, "pid": os.getpid(), "host": socket.gethostname(),
                           "listening": follower.listening, **({"shard": shard} if shard else {})}
    if r is None:
        return {**out, "resident": False}
    content = await r.run(r.index.content)
    lag = await store.lag(c, content["watermark"])
    state = r.state()
    return {**out, **content, **lag, "resident": True, "loaded": r.loaded, "engine": state["engine"],
            "fresh_ms": state["fresh_ms"], "rebuilding": state["rebuilding"]}


async def gather(store: CollectionStore, follower: Follower, c: Collection, own: dict[str, Any], verify: bool,
                 wait_s: float = 1.0) -> dict[str, Any]:
    """Every listening process's report beside PostgreSQL's head (and, with `verify`, its rows and digest)."""
    others: list[dict[str, Any]] = []
    expected = 0
    if follower.listening:
        expected = await store.live_followers(APPLICATION_PREFIX) - 1
        if expected > 0:
            request = uuid.uuid4().hex
            await store.ask_for_reports(c, request)
            deadline = time.monotonic() + wait_s
            while True:
                others = [x for x in await store.reports(c, request) if x["process"] != follower.process]
                if len(others) >= expected or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
    postgres = await store.content(c) if verify else {"seq": await store.head(c)}
    return {"postgres": postgres, "process": follower.process, "replicas": [own, *others],
            "processes_expected": expected + 1}
