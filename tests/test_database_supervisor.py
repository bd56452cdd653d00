"""The database supervisor: checks asked for together run one at a time."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import asyncpg

from conftest import run
from service.database.supervisor import DatabaseSupervisor
from service.metrics import Metrics


class StoppedServer:
    """The embedded server's handle, for a server that is down: each restart takes a while and says how many ran
    at once (the database itself is never answered for: the pool's probes reach a closed port)."""

    def __init__(self, dsn: str) -> None:
        self.dsn, self.running, self.most, self.lock = dsn, 0, 0, threading.Lock()

    def alive(self) -> bool:
        return False

    def restart(self) -> str:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.2)
        with self.lock:
            self.running -= 1
        return self.dsn


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_checks_asked_for_together_never_restart_the_server_twice_at_once():
    """The loop's tick and requests' was_down() may check at once: two checks restarted the embedded server in
    two threads together, and the later one marked the database down again after it had recovered."""
    async def scenario() -> int:
        dsn = f"postgresql://nobody@127.0.0.1:{closed_port()}/none"
        pool = await asyncpg.create_pool(dsn, min_size=0, max_size=2)
        server = StoppedServer(dsn)
        try:
            supervisor = DatabaseSupervisor(pool, server, dsn=dsn, pool_connect_kwargs={}, metrics=Metrics(),  # type: ignore[arg-type]
                                            probe_timeout_s=1.0)
            await asyncio.gather(*(supervisor.check() for _ in range(3)))
            assert supervisor.state == "unreachable" and supervisor.restarts == 3
        finally:
            await pool.close()
        return server.most

    assert run(scenario()) == 1


class StallingPool:
    """A pool whose first probe finds the event loop stalled (a long callback) while it waits for its answer."""

    def __init__(self, pool: asyncpg.Pool, stall_s: float) -> None:
        self.pool, self.stall_s, self.probes = pool, stall_s, 0

    async def acquire(self, timeout: float | None = None) -> "StallingPool.Held":
        self.probes += 1
        return StallingPool.Held(await self.pool.acquire(timeout=timeout), self.stall_s if self.probes == 1 else 0)

    async def release(self, held: "StallingPool.Held") -> None:
        await self.pool.release(held.conn)

    class Held:
        def __init__(self, conn, stall_s: float) -> None:
            self.conn, self.stall_s = conn, stall_s

        async def fetchval(self, query: str):
            time.sleep(self.stall_s)  # the loop blocked past the probe's timeout
            return await self.conn.fetchval(query)


def test_a_stalled_event_loop_does_not_mark_a_live_database_down(server_dsn):
    """A probe timed out because the process's own loop stalled (a large answer encoded) marked PostgreSQL
    unreachable, and writes answered 503 for a second. A probe that times out is asked once more."""
    async def scenario() -> tuple[str, int]:
        pool = await asyncpg.create_pool(server_dsn, min_size=1, max_size=2)
        stalling = StallingPool(pool, stall_s=0.5)
        try:
            supervisor = DatabaseSupervisor(stalling, None, dsn=server_dsn, pool_connect_kwargs={},  # type: ignore[arg-type]
                                            metrics=Metrics(), probe_timeout_s=0.2)
            await supervisor.check()
            return supervisor.state, stalling.probes
        finally:
            await pool.close()

    assert run(scenario()) == ("ok", 2)
