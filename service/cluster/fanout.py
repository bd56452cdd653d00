"""Calling the replicas of every shard: one replica per shard for a search, the next one when it is down.

What a replica handle is, and how a call reaches it, belongs to the layer that placed the replicas (Ray actors in
ray_layer.py, plain objects in the tests); this module only chooses replicas and fails over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from indexes.errors import InvalidInput, ShardUnavailable
from indexes.resident import SearchResult
from service.process.link import EngineClient
from service.process.messages import CatchUp, Failure, ShardAnswer, ShardSearch, float32_bytes

log = logging.getLogger("switchyard.cluster")

# Errors that are the request's (a bad parameter): every replica would raise them alike, so they go back to the
# client. Anything else is the replica's trouble (dead, restarting, loading, behind, its database connection
# gone, a catalog a moment old): another replica of the shard is asked.
REQUEST_ERRORS: tuple[type[BaseException], ...] = (InvalidInput,)

HEDGE_FACTOR = 4.0  # ask another replica after this many times the usual answer time ...
HEDGE_MIN_S, HEDGE_MAX_S = 0.05, 1.0  # ... within these bounds
ALL_DOWN_WAIT_S = 1.0  # how long a shard with no replica up may take to answer before a 503

LAYOUT_TIMEOUT_S = 5.0  # a replica that takes longer to describe itself is reported as not answering
WATCH_S = 1.0  # how often the ingress asks every replica how it is ...
WATCH_TIMEOUT_S = 5.0  # ... and counts it down if it takes longer to say

# Hot calls (a search, a nudge after each write) go over a replica's direct channel when it offers one (`data`).
DIRECT = frozenset({"search", "catch_up"})

Call = Callable[[Any, str, tuple], Awaitable[Any]]  # (replica handle, method name, arguments) -> result


def direct_call(method: str, args: tuple) -> ShardSearch | CatchUp:
    """A hot call's arguments (ShardHost.search / catch_up) as the typed message its direct channel takes."""
    if method == "catch_up":
        return CatchUp(*args)
    name, queries, k, params, payload_filter, consistency, seq, recall_target = args
    return ShardSearch(name, float32_bytes(queries), queries.shape[1], k, params, payload_filter, consistency, seq,
                       recall_target)


class ShardSet:
    def __init__(self, replicas: list[list[Any]], call: Call, *,
                 request_errors: tuple[type[BaseException], ...] = REQUEST_ERRORS,
                 call_timeout_s: float = 30.0) -> None:
        if not replicas or any(not r for r in replicas):
            raise ValueError("every shard needs at least one replica")
        self.replicas = replicas  # [shard][replica] -> handle
        self._call = call
        self.request_errors = request_errors
        self.call_timeout_s = call_timeout_s
        self._turn = [0] * len(replicas)
        # (shard, replica) that failed a call or was not ready when last asked; unknown ones count as down.
        self._down = {(s, r) for s, row in enumerate(replicas) for r in range(len(row))}
        self._usual_s: dict[str, float] = {}  # moving average of answer times, per method
        self._watching: asyncio.Future | None = None
        # (shard, replica) -> host:port of its direct channel and the key its frames are signed with
        self._direct: dict[tuple[int, int], tuple[str, bytes]] = {}
        self._clients: dict[str, EngineClient] = {}
        self.kind: str | None = None  # the engine the replicas serve with ("cpu" or "gpu"), once one said
        self.watched_with: tuple | None = None  # what the last watch that was answered told the replicas

    @property
    def shards(self) -> int:
        return len(self.replicas)

    async def call(self, shard: int, replica: int, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        async with asyncio.timeout(timeout_s or self.call_timeout_s):
            channel = self._direct.get((shard, replica)) if method in DIRECT else None
            if channel is not None:
                return await self._call_direct(*channel, method, args)
            return await self._call(self.replicas[shard][replica], method, args)

    async def _call_direct(self, address: str, key: bytes, method: str, args: tuple) -> Any:
        client = self._clients.get(address)
        if client is None:
            host, _, port = address.rpartition(":")
            client = self._clients[address] = EngineClient((host, int(port)), key)
        reply = await client.call(direct_call(method, args))  # EngineGone (a ConnectionError) when unreachable
        value = reply.value
        if isinstance(value, Failure):
            raise value.error()
        if isinstance(value, ShardAnswer):
            return SearchResult(value.ids, value.distances, value.watermark, value.plan), value.engine
        return value

    def _order(self, shard: int) -> list[int]:
        """Round robin over the shard's replicas, those known to be down last."""
        n = len(self.replicas[shard])
        start = self._turn[shard] = (self._turn[shard] + 1) % n
        order = [(start + i) % n for i in range(n)]
        return sorted(order, key=lambda r: (shard, r) in self._down)

    async def on_shard(self, shard: int, method: str, *args: Any) -> Any:
        """The first answer from a replica of `shard`; ShardUnavailable if none can give one.

        A replica that does not answer within the hedge delay (a few times the usual answer time) may be dead
        or restarting, which Ray only tells once the restart is over: the next replica is asked too, and the
        first answer wins (a hedged request, as in "The Tail at Scale")."""
        order = self._order(shard)
        pending: dict[asyncio.Future, int] = {}
        trouble: BaseException | None = None
        asked = 0
        started = time.perf_counter()

        def ask_next() -> None:
            nonlocal asked
            replica = order[asked]
            asked += 1
            pending[asyncio.ensure_future(self.call(shard, replica, method, *args))] = replica

        # With every replica known down (killed, restarting, loading), a short wait, then 503 with Retry-After.
        deadline = time.monotonic() + (ALL_DOWN_WAIT_S if all(self.is_down(shard, r) for r in order)
                                       else self.call_timeout_s)
        ask_next()
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    trouble = TimeoutError(f"no answer within {self.call_timeout_s:g} s")
                    break
                hedge = min(self._hedge_s(method), left) if asked < len(order) else left
                done, _ = await asyncio.wait(pending, timeout=hedge, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    if asked < len(order):
                        ask_next()
                    continue
                for task in done:
                    replica = pending.pop(task)
                    if task.exception() is None:
                        self._answered(method, time.perf_counter() - started)
                        return task.result()
                    if isinstance(error := task.exception(), self.request_errors):
                        raise error
                    self._down.add((shard, replica))  # until the watch finds it ready again
                    trouble = task.exception()
                if not pending and asked < len(order):
                    ask_next()
        finally:
            for task in pending:
                task.cancel()
        reason = f"{type(trouble).__name__}: {str(trouble).splitlines()[0] if str(trouble) else ''}"
        raise ShardUnavailable(f"no replica of shard {shard} of {self.shards} can answer now ({reason})",
                               field="engine")

    def _hedge_s(self, method: str) -> float:
        usual = self._usual_s.get(method)
        return HEDGE_MAX_S if usual is None else min(HEDGE_MAX_S, max(HEDGE_MIN_S, HEDGE_FACTOR * usual))

    def _answered(self, method: str, seconds: float) -> None:
        usual = self._usual_s.get(method)
        self._usual_s[method] = seconds if usual is None else 0.9 * usual + 0.1 * seconds

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

    async def layout(self, label: str, method: str = "where", *args: Any) -> list[dict[str, Any]]:
        """Every part's replicas as they describe themselves (or why they could not)."""
        answers = await self.on_every_replica(method, *args, timeout_s=LAYOUT_TIMEOUT_S)
        return [{label: p, "replicas": [described(a) for a in row]} for p, row in enumerate(answers)]

    def start_watching(self, start_args: Callable[[], tuple] = tuple) -> None:
        self._watching = asyncio.ensure_future(self._watch(start_args))

    async def stop_watching(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
            self._watching = None

    async def _watch(self, start_args: Callable[[], tuple] = tuple) -> None:
        """Forever: ask every replica to `start(*start_args())` (idempotent: the first call starts a host, and one
        that Ray restarted has no other way to learn it should load) and note which are ready."""
        while True:
            args = start_args()
            self.note(await self.on_every_replica("start", *args, timeout_s=WATCH_TIMEOUT_S))
            self.watched_with = args
            await asyncio.sleep(WATCH_S)

    def note(self, answers: list[list[Any]]) -> None:
        """Take in every replica's `where()` (or the exception its call raised): which are up, and the engine."""
        for s, row in enumerate(answers):
            for r, answer in enumerate(row):
                if isinstance(answer, BaseException) or not answer.get("ready"):
                    self._down.add((s, r))
                else:
                    self._down.discard((s, r))
                    self.kind = answer.get("engine") or self.kind
                if not isinstance(answer, BaseException):
                    key = answer.get("channel_key")
                    self._remember_direct(s, r, (answer["data"], bytes.fromhex(key)) if answer.get("data") and key
                                          else None)

    def _remember_direct(self, shard: int, replica: int, channel: tuple[str, bytes] | None) -> None:
        old = self._direct.get((shard, replica))
        if channel == old:
            return
        if channel is None:
            self._direct.pop((shard, replica), None)
        else:
            self._direct[(shard, replica)] = channel
        if old is not None and old not in self._direct.values():  # a restarted replica listens elsewhere
            client = self._clients.pop(old[0], None)
            if client is not None:
                asyncio.ensure_future(client.close())

    def every_shard_up(self) -> bool:
        return all(any((s, r) not in self._down for r in range(len(row))) for s, row in enumerate(self.replicas))

    def is_down(self, shard: int, replica: int) -> bool:
        return (shard, replica) in self._down


def described(answer: Any) -> Any:
    """A replica's answer, or what its call raised, as JSON."""
    if isinstance(answer, BaseException):
        first = str(answer).splitlines()[0] if str(answer) else ""
        return {"ready": False, "error": f"{type(answer).__name__}: {first}"}
    return answer
