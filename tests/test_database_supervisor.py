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
