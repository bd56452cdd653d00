"""The event loop's lag, and the share of new requests refused while it runs behind, as PIE (RFC 8033) drops
packets by their queueing delay.

A search answered on the event loop itself (an inline answer) holds its in-flight slot for microseconds, so the
limits of service/admission/pressure.py never see the loop full: past the loop's capacity, requests wait unread in
socket buffers, where nothing counts them. What shows that backlog is how long readable data waits for the loop, so
a probe measures exactly that: every TICK_S a byte goes into a socket pair whose reading end the loop watches beside
the clients' sockets, and the time until the loop reads it is one sample; the least of the last WINDOW (a standing
backlog, not one slow turn: a garbage collection, a scrape) is the lag (switchyard_event_loop_lag_seconds). Only a
backlog of requests counts towards refusing them: a sample during which fewer than QUEUED_MIN requests arrived is a
loop slowed by something else (a job's thread holding the GIL, a busy core), which refusals cannot shorten. Once the
lag has exceeded SWITCHYARD_LOOP_LAG_TARGET_MS for BURST_S (PIE's burst allowance: a burst the loop drains within that
is no overload), the share admitted is cut in proportion, for every tick each sample stands for; while it does not
exceed it, the share grows back a little per sample (AIMD). Why and what it measured: docs/design/serving.md, "The
event loop's own backlog".
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from time import monotonic

TICK_S = 0.005  # a probe this often (two syscalls and two callbacks: about 0.2% of a core)
WINDOW = 3  # samples whose least is the standing lag
DECREASE = 0.9  # behind: the admitted share times target / lag per tick, but at least this (halving it per sample
# held 0.7 refused at 2x capacity with a fifth of the core idle)
INCREASE = 0.01  # on time: the admitted share plus this, per sample
MAX_SHARE = 0.99  # a share of requests always goes through: their latency keeps telling the backlog
BURST_S = 0.1  # how long the lag may stand above the target before any request is refused (RFC 8033: 150 ms)
QUEUED_MIN = 3  # requests arriving while a probe waits that make its wait a backlog of requests (one client at a
# time, answered as the loop reads the probe, brings at most two)


class LoopLag:
    """One event loop's lag probe and the share of new requests it refuses (see the module's docstring).
    `target_s`: the standing lag kept; 0: none, the lag is only measured, nothing refused."""

    def __init__(self, target_s: float) -> None:
        self.target_s = target_s
        self.share = 0.0  # of new requests refused now
        self.lag_s = 0.0  # the standing lag of the last samples
        self.queued_s = 0.0  # ... counting only samples with a backlog of requests (QUEUED_MIN): what it refuses for
        self.arrived = 0  # requests seen (arrive)
        self._samples: deque[float] = deque(maxlen=WINDOW)
        self._queued: deque[float] = deque(maxlen=WINDOW)
        self._credit = 0.0  # refusals owed: share added per request, one refused per whole unit
        self._burst_left = BURST_S  # of the burst allowance: renewed while the loop keeps up, used while behind
        self._sent, self._arrived_then = 0.0, 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Probe `loop` from now on (idempotent)."""
        if self._pair is not None:
            return
        reading, writing = socket.socketpair()
        reading.setblocking(False)
        writing.setblocking(False)
        self._loop, self._pair = loop, (reading, writing)
        loop.add_reader(reading.fileno(), self._read)
        self._timer = loop.call_later(TICK_S, self._probe)

    def stop(self) -> None:
        if self._pair is None or self._loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        reading, writing = self._pair
        self._loop.remove_reader(reading.fileno())
        reading.close()
        writing.close()
        self._pair, self._timer = None, None

    def arrive(self) -> None:
        """One request arrived (called once per request the gate may refuse, before refuse_next)."""
        self.arrived += 1

    def refuse_next(self) -> bool:
        """Whether the request arriving now is one of the share refused (spread evenly, not drawn at random)."""
        if not self.share:
            return False
        self._credit += self.share
        if self._credit < 1.0:
            return False
        self._credit -= 1.0
        return True

    def _probe(self) -> None:
        assert self._pair is not None and self._loop is not None
        self._timer = None
        self._sent, self._arrived_then = monotonic(), self.arrived
        try:
            self._pair[1].send(b"\0")
        except OSError:  # (full: cannot happen with one byte at a time outstanding) the next tick tries again
            self._timer = self._loop.call_later(TICK_S, self._probe)

    def _read(self) -> None:
        assert self._pair is not None and self._loop is not None
        try:
            self._pair[0].recv(64)
        except OSError:
            return
        self.observe(monotonic() - self._sent, self.arrived - self._arrived_then)
        self._timer = self._loop.call_later(TICK_S, self._probe)

    def observe(self, lag_s: float, arrived: int = QUEUED_MIN) -> None:
        """One sample: the probe waited `lag_s` while `arrived` requests arrived. The share moves by the standing
        lag's distance from the target (AIMD, on the admitted share), where requests made that lag."""
        self._samples.append(lag_s)
        self._queued.append(lag_s if arrived >= QUEUED_MIN else 0.0)
        self.lag_s, self.queued_s = min(self._samples), min(self._queued)
        if self.target_s <= 0:
            return
        if not self.share and self.queued_s <= self.target_s / 2:  # keeping up, nothing refused: a burst may come
            self._burst_left = BURST_S
        elif self._burst_left > 0 and self.queued_s > self.target_s:  # a burst, or an overload's onset: the time
            # this sample stands for is taken from the allowance
            self._burst_left -= TICK_S + lag_s
            return
        admitted = 1.0 - self.share
        if self.queued_s > self.target_s:  # behind: admit less, in proportion, for each tick this sample stands for
            admitted *= max(DECREASE, self.target_s / self.queued_s) ** (1.0 + lag_s / TICK_S)  # (a sample comes
            # only once the loop reads it: at a backlog of 0.5 s, one sample per half second)
        else:  # keeping up: admit a little more
            admitted += INCREASE
        self.share = min(MAX_SHARE, max(0.0, 1.0 - admitted))
        if not self.share:
            self._credit = 0.0
