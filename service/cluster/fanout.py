"""Calling the replicas of every shard: one replica per shard for a search, the next one when it is down.

What a replica handle is, and how a call reaches it, belongs to the layer that placed the replicas (Ray actors in
ray_layer.py, plain objects in the tests); this module only chooses replicas and fails over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from indexes.errors import EngineFailed, EngineUnavailable, NotCaughtUp, ShardUnavailable

log = logging.getLogger("switchyard.cluster")

DOWN_S = 2.0  # a replica that failed is asked last for this long
# The replica's own troubles: another replica of the shard may answer. Anything else (a bad filter, an unknown
# collection) is the request's and would fail the same way everywhere.
REPLICA_TROUBLE: tuple[type[BaseException], ...] = (EngineUnavailable, EngineFailed, NotCaughtUp, TimeoutError,
                                                    ConnectionError)

Call = Callable[[Any, str, tuple], Awaitable[Any]]  # (replica handle, method name, arguments) -> result


class ShardSet:
    def __init__(self, replicas: list[list[Any]], call: Call, *, down: tuple[type[BaseException], ...] = (),
                 call_timeout_s: float = 30.0) -> None:
        if not replicas or any(not r for r in replicas):
            raise ValueError("every shard needs at least one replica")
        self.replicas = replicas  # [shard][replica] -> handle
        self._call = call
        self.down_errors = REPLICA_TROUBLE + down  # the placing layer adds its own (a dead actor)
        self.call_timeout_s = call_timeout_s
        self._turn = [0] * len(replicas)
        self._down_until: dict[tuple[int, int], float] = {}
        self.kind: str | None = None  # the engine the replicas serve with ("cpu" or "gpu"), once one said

    @property
    def shards(self) -> int:
        return len(self.replicas)

    async def call(self, shard: int, replica: int, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        async with asyncio.timeout(timeout_s or self.call_timeout_s):
            return await self._call(self.replicas[shard][replica], method, args)

    def _order(self, shard: int) -> list[int]:
        """Round robin over the shard's replicas, those that failed lately last."""
        n = len(self.replicas[shard])
        start = self._turn[shard] = (self._turn[shard] + 1) % n
        now = time.monotonic()
        order = [(start + i) % n for i in range(n)]
        return sorted(order, key=lambda r: self._down_until.get((shard, r), 0.0) > now)

    async def on_shard(self, shard: int, method: str, *args: Any) -> Any:
        """The first answer from a replica of `shard`, trying each in turn; ShardUnavailable if none can."""
        trouble: BaseException | None = None
        for replica in self._order(shard):
            try:
                out = await self.call(shard, replica, method, *args)
            except self.down_errors as exc:
                self._down_until[(shard, replica)] = time.monotonic() + DOWN_S
                trouble = exc
                continue
            self._down_until.pop((shard, replica), None)
            return out
        reason = f"{type(trouble).__name__}: {str(trouble).splitlines()[0] if str(trouble) else ''}"
        raise ShardUnavailable(f"no replica of shard {shard} of {self.shards} can answer now ({reason})",
                               field="engine")

    async def on_every_shard(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(self.on_shard(s, method, *args) for s in range(self.shards))))

    async def on_every_replica(self, method: str, *args: Any, shards: list[int] | None = None,
                               timeout_s: float | None = None) -> list[list[Any]]:
        """Every replica's answer, or the exception it raised, by shard and replica."""
        picked = range(self.shards) if shards is None else shards
        calls = [self.call(s, r, method, *args, timeout_s=timeout_s) for s in picked
                 for r in range(len(self.replicas[s]))]
        flat = iter(await asyncio.gather(*calls, return_exceptions=True))
        return [[next(flat) for _ in self.replicas[s]] for s in picked]

    def note(self, answers: list[list[Any]]) -> None:
        """Take in every replica's `where()` (or the exception its call raised): which are up, and the engine."""
        until = time.monotonic() + DOWN_S
        for s, row in enumerate(answers):
            for r, answer in enumerate(row):
                if isinstance(answer, BaseException) or not answer.get("ready"):
                    self._down_until[(s, r)] = until
                else:
                    self._down_until.pop((s, r), None)
                    self.kind = answer.get("engine") or self.kind

    def is_down(self, shard: int, replica: int) -> bool:
        return self._down_until.get((shard, replica), 0.0) > time.monotonic()
