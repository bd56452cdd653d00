"""A cap on the connections a process holds open, below its file-descriptor limit: past it, idle connections are
closed first (nginx's reusable connections), and only when none is idle is a new one refused, with a 503 problem.

Without a cap, about 20,000 idle TCP connections used every descriptor of a process (RLIMIT_NOFILE 20,000): the
event loop could accept no more, and libuv closed each new connection unanswered until some went away. Now:
- `switchyard serve` raises its soft RLIMIT_NOFILE to the hard limit (its children inherit it) and caps each
  process's connections at SWITCHYARD_MAX_CONNECTIONS (default: that limit less a reserve for PostgreSQL
  connections, files, the links between processes: `default_cap`);
- a connection is idle while it has never sent a byte, or waits between two requests (uvicorn's keep-alive timer,
  SWITCHYARD_KEEP_ALIVE_S, is armed): such a connection costs the client nothing to lose (a new connection would
  wait on nothing), so a connection arriving at the cap closes the one idle longest;
- with no idle connection to close (every one is sending or being answered), the new connection's requests are
  answered 503 `too-many-connections` with Retry-After and `Connection: close`; past the cap plus half the reserve
  it is closed at once, so that the process never runs out of descriptors itself.

The cap reaches each uvicorn process as its `limit_concurrency` (config and command line alike); this protocol
enforces it instead of uvicorn's check (a plain-text 503 counting connections and tasks), which it turns off.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from typing import Any

from starlette.types import Receive, Scope, Send

from service.errors import problem_response
from service.http.pipelining import BoundedPipeline

log = logging.getLogger("switchyard")
RESERVE_SHARE, RESERVE_LEAST = 10, 256  # descriptors kept for anything but client connections: a tenth, >= 256
WARN_EVERY_S = 10.0
# What this protocol reads or sets of HttpToolsProtocol's own state (checked against the installed uvicorn by
# tests/test_connections.py).
UVICORN_STATE = ("limit_concurrency", "connections", "server_state", "transport", "app", "timeout_keep_alive_task",
                 "pipeline", "flow")  # the last two: service/http/pipelining.py


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


def default_cap(fd_limit: int) -> int:
    """Connections a process may hold with `fd_limit` descriptors: the limit less a reserve (a tenth, at least 256)
    for PostgreSQL connections, files and sockets of its own, and refused connections (half of it)."""
    return max(16, fd_limit - max(RESERVE_LEAST, fd_limit // RESERVE_SHARE))


def connection_cap(configured: int | None, fd_limit: int) -> int:
    """The cap in force: SWITCHYARD_MAX_CONNECTIONS, at most (and by default) `default_cap(fd_limit)`."""
    most = default_cap(fd_limit)
    if configured is not None and configured > most:
        log.warning("SWITCHYARD_MAX_CONNECTIONS=%d is too close to the open-file limit (%d): capping connections at "
                    "%d", configured, fd_limit, most)
    return most if configured is None else min(configured, most)


class Connections:
    """The connections of one server (uvicorn's ServerState) against the cap: the idle ones, longest idle first."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.ceiling = cap + max(1, (max(RESERVE_LEAST, cap // (RESERVE_SHARE - 1)) // 2))  # refused ones too
        self.idle: OrderedDict[CappedProtocol, None] = OrderedDict()
        self.closing = 0  # idle connections closed by the cap, not yet gone
        self.warned = 0.0

    @staticmethod
    def of(protocol: "CappedProtocol") -> "Connections":
        state = protocol.server_state
        table = getattr(state, "switchyard_connections", None)
        if table is None:
            assert protocol.cap is not None
            table = Connections(protocol.cap)
            state.switchyard_connections = table  # type: ignore[attr-defined]
        return table

    def admit(self, new: "CappedProtocol", open_now: int) -> bool:
        """Make room for `new`, one of `open_now` connections, by closing idle ones: whether it fits under the cap."""
        over = open_now - self.closing - self.cap
        while over > 0 and self.idle:
            oldest = next(iter(self.idle))
            self.idle.pop(oldest)
            oldest.evicted = True
            self.closing += 1
            oldest.transport.close()
            over -= 1
        if over > 0 and time.monotonic() - self.warned > WARN_EVERY_S:
            self.warned = time.monotonic()
            log.warning("%d connections open, none idle, at the cap of %d (SWITCHYARD_MAX_CONNECTIONS): new ones "
                        "are answered 503 too-many-connections", open_now, self.cap)
        return over <= 0


async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to each request of a connection over the cap: 503, and the connection closed after it."""
    detail = ("the service holds as many connections as it may (SWITCHYARD_MAX_CONNECTIONS), none of them idle; "
              "retry after Retry-After")
    await problem_response(503, "too-many-connections", "Too many connections", detail, instance=scope.get("path"),
                           headers={"Retry-After": "1", "Connection": "close"})(scope, receive, send)


class CappedProtocol(BoundedPipeline):
    """uvicorn's httptools protocol under the connection cap (config.limit_concurrency; None: no cap), with its
    pipelined requests bounded (service/http/pipelining.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cap: int | None = self.limit_concurrency
        self.limit_concurrency = None  # uvicorn's own check: replaced by the cap
        self.table: Connections | None = None
        self.refused = False  # over the cap with no idle connection to close: every request answered 503
        self.evicted = False  # closed by the cap to make room

    # The keep-alive timer is armed exactly while the connection waits between requests (by uvicorn once a response
    # is complete, by the express protocol after an inline answer) and disarmed by the next byte: the connection is
    # idle while it is set.
    @property  # type: ignore[override]
    def timeout_keep_alive_task(self) -> asyncio.TimerHandle | None:
        return self._keep_alive_task

    @timeout_keep_alive_task.setter
    def timeout_keep_alive_task(self, task: asyncio.TimerHandle | None) -> None:
        self._keep_alive_task = task
        table = getattr(self, "table", None)
        if table is not None and not self.refused:
            if task is None:
                table.idle.pop(self, None)
            else:
                table.idle[self] = None
                table.idle.move_to_end(self)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.cap is None:
            return
        self.table = table = Connections.of(self)
        if len(self.connections) > table.ceiling:  # no room even to say so: closed at once
            self.refused = True
            transport.close()
        elif not table.admit(self, len(self.connections)):
            self.refused = True
        else:
            table.idle[self] = None  # idle until its first byte

    def data_received(self, data: bytes) -> None:
        if self.table is not None:
            self.table.idle.pop(self, None)
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.table is not None:
            self.table.idle.pop(self, None)
            if self.evicted:
                self.table.closing -= 1
                self.evicted = False
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        if not self.refused:
            super().on_headers_complete()
            return
        app, self.app = self.app, refuse  # as uvicorn's own limit_concurrency answers: the request goes to `refuse`
        try:
            super().on_headers_complete()
        finally:
            self.app = app
