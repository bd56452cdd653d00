"""Following PostgreSQL's change log in one process: a LISTEN connection that hears every commit at once, and
a periodic poll of every collection's head that catches what a dropped connection missed and keeps bounded
staleness true while nothing is written.

The listening connection names itself `switchyard-follower <process>` (application_name), so the processes
following a database can be counted from pg_stat_activity. It is re-established after a drop, with backoff, and
each re-establishment polls at once: notifications sent while nobody listened are gone.

Waits with a time limit use `asyncio.timeout`, not `asyncio.wait_for`: on Python 3.11 wait_for can swallow a
cancellation that arrives as its awaitable completes, and a loop that lost its cancellation never stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Protocol

import asyncpg

from .store import CHANNEL, CollectionStore
from .tasks import stop_tasks

log = logging.getLogger("switchyard.vectors.follower")

APPLICATION_PREFIX = "switchyard-follower "


class FollowerHandler(Protocol):
    def on_change(self, collection_id: int, seq: int) -> None: ...

    def on_catalog(self, collection_id: int) -> None: ...

    def on_report(self, collection_id: int, request: str) -> None: ...

    def on_heads(self, heads: dict[int, tuple[str, int]], read_at: float) -> None: ...


class Follower:
    def __init__(self, dsn: str | None, store: CollectionStore, handler: FollowerHandler, *, process: str,
                 poll_s: float) -> None:
        self.dsn, self.store, self.handler = dsn, store, handler
        self.process, self.poll_s = process, poll_s
        self.listening = False
        self.reconnects = 0
        self._poke = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @property
    def application_name(self) -> str:
        return APPLICATION_PREFIX + self.process

    async def start(self) -> None:
        if self.dsn is not None:
            self._tasks.append(asyncio.create_task(self._listen_loop(), name="vectors-listen"))
        self._tasks.append(asyncio.create_task(self._poll_loop(), name="vectors-poll"))

    async def stop(self) -> None:
        self._stopping = True
        await stop_tasks(*self._tasks)
        self._tasks.clear()

    def poll_now(self) -> None:
        self._poke.set()

    # -- LISTEN ----------------------------------------------------------------------------------------
    async def _listen_loop(self) -> None:
        delay = 0.1
        first = True
        while not self._stopping:
            conn = None
            try:
                conn = await asyncpg.connect(self.dsn, timeout=10,
                                             server_settings={"application_name": self.application_name[:63]})
                lost = asyncio.Event()
                # bound now: a late termination of this connection sets its own event, never a later connection's
                conn.add_termination_listener(lambda _conn, lost=lost: lost.set())
                await conn.add_listener(CHANNEL, self._on_notification)
                self.listening = True
                if not first:
                    self.reconnects += 1
                    log.info("listening for changes again (reconnect %d)", self.reconnects)
                first, delay = False, 0.1
                self.poll_now()  # what was committed while nobody listened
                while not lost.is_set():
                    if not await _within(5.0, lost.wait()):  # a half-open connection stays silent: ask it
                        async with asyncio.timeout(5.0):
                            await conn.fetchval("SELECT 1")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the poll covers the gap; keep trying
                log.warning("change listener lost (%s: %s); reconnecting in %.1f s", type(exc).__name__, exc, delay)
            finally:
                self.listening = False
                if conn is not None and not conn.is_closed():
                    conn.terminate()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _on_notification(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            if payload.startswith("c:"):
                self.handler.on_catalog(int(payload[2:]))
            elif payload.startswith("r:"):
                _, cid, request = payload.split(":", 2)
                self.handler.on_report(int(cid), request)
            else:
                cid, seq = payload.split(":")
                self.handler.on_change(int(cid), int(seq))
        except ValueError:
            log.warning("ignoring a malformed change notification %r", payload[:100])

    # -- poll ------------------------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        failing = False
        while not self._stopping:
            read_at = time.monotonic()
            try:
                heads = await self.store.heads()
                self.handler.on_heads(heads, read_at)
                if failing:
                    log.info("change poll works again")
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - bounded-staleness searches see the age grow
                if not failing:
                    log.warning("change poll failed (%s: %s); retrying", type(exc).__name__, exc)
                failing = True
            await _within(self.poll_s, self._poke.wait())
            self._poke.clear()


async def _within(seconds: float, waiting: Awaitable[object]) -> bool:
    """Await `waiting` for at most `seconds`; whether it finished."""
    try:
        async with asyncio.timeout(seconds):
            await waiting
        return True
    except TimeoutError:
        return False
