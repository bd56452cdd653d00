"""The process's in-flight limit, following the latency of what it admits: serve promptly, refuse the rest.

As TCP Vegas does: the limit is cut while answered requests take more than `tolerance` times their unqueued latency
(per kind of request: the least mean of FOUR consecutive answers over WINDOW_S), and grows by a tenth while they do
not and requests had to wait. A request that finds the limit full waits in a FIFO queue of two waiters per slot for
at most `max_wait_s`; when the queue is full the oldest waiter is answered 503 (drop from the head, as CoDel does).
Heavy work (SSB queries, SQL, geometry) may fill at most half the limit. Why: docs/design/serving.md.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

INTERVAL_S = 0.1  # the limit moves at most this often ...
MIN_ANSWERS = 8  # ... and only on this many answers
WINDOW_S = 10.0  # how long an unqueued latency is remembered
FOUR = 4  # answers averaged into one sample of a kind's latency
DECREASE = 0.75
MAX_DECREASE = 0.25  # the most one interval cuts: to a quarter
INCREASE = 0.1


class KindLatency:
    """One kind of request's unqueued latency: the windowed least of means of FOUR consecutive answers."""

    __slots__ = ("least", "samples", "total", "count")

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque()  # (when, mean), means increasing: head is the least
        self.least = 0.0  # 0: not known yet
        self.total, self.count = 0.0, 0

    def add(self, seconds: float, now: float) -> None:
        self.total += seconds
        self.count += 1
        if self.count < FOUR:
            return
        mean, self.total, self.count = self.total / FOUR, 0.0, 0
        while self.samples and self.samples[0][0] < now - WINDOW_S:
            self.samples.popleft()
        while self.samples and self.samples[-1][1] >= mean:
            self.samples.pop()
        self.samples.append((now, mean))
        self.least = self.samples[0][1]


class InflightLimit:
    def __init__(self, ceiling: int, floor: int, tolerance: float, max_wait_s: float) -> None:
        self.ceiling = ceiling
        self.max_wait_s = max_wait_s
        self.floor = max(1, min(floor, ceiling))
        self.tolerance = tolerance  # 0: a fixed limit of `ceiling`
        self.limit = ceiling  # generous until latency says otherwise
        self.inflight = 0
        self.heavy = 0  # of which heavy work
        self.waiters: deque[tuple[asyncio.Future, bool]] = deque()  # (True: handed a slot, False: dropped; light)
        self.slowdown = 0.0  # of the last interval: latency over unqueued latency
        self.kinds: dict[object, KindLatency] = {}
        self._interval_end = time.monotonic() + INTERVAL_S
        self._latency = self._unqueued = 0.0
        self._answers = 0
        self._constrained = False  # whether a request had to wait or was refused in this interval

    def _room(self, light: bool) -> bool:
        return self.inflight < self.limit and (light or self.heavy < max(1, self.limit // 2))

    def _take(self, light: bool) -> None:
        self.inflight += 1
        self.heavy += not light

    def admit(self, light: bool) -> bool:
        """A slot now, if one is free and nobody waits for one; `light`: not heavy work (see above)."""
        if not self.waiters and self._room(light):
            self._take(light)
            return True
        self._constrained = True
        return False

    async def enter(self, light: bool) -> bool:
        """A slot, now or after a wait in the queue; False: refused (the queue is full, or no slot came in time)."""
        if self.admit(light):
            return True
        if len(self.waiters) >= 2 * self.limit:
            self.waiters.popleft()[0].set_result(False)  # the oldest makes way
        handed = asyncio.get_running_loop().create_future()
        waiter = (handed, light)
        self.waiters.append(waiter)
        try:
            await asyncio.wait((handed,), timeout=self.max_wait_s)
        except BaseException:  # cancelled (the client went away): give back a slot handed over meanwhile
            self._forget(waiter)
            raise
        if handed.done():
            return handed.result()  # True: _hand_over counted it in; False: dropped from the head
        self._forget(waiter)
        return False

    def _forget(self, waiter: tuple[asyncio.Future, bool]) -> None:
        handed, light = waiter
        if handed.done() and not handed.cancelled():
            if handed.result():
                self.leave(light)  # handed a slot it will not use
            return
        handed.cancel()
        try:
            self.waiters.remove(waiter)
        except ValueError:
            pass

    def _hand_over(self) -> None:
        """Give free slots to waiters, first come first served among those the heavy share lets in."""
        while self.waiters and self.inflight < self.limit:
            waiter = next((w for w in self.waiters if self._room(w[1])), None)
            if waiter is None:
                return
            self.waiters.remove(waiter)
            self._take(waiter[1])
            waiter[0].set_result(True)

    def leave(self, light: bool, kind: object = None, seconds: float = 0.0) -> None:
        """Count one request out; `kind` (its route) and its latency if it succeeded (failures say nothing of
        queueing: many are refusals that took no time)."""
        self.inflight -= 1
        self.heavy -= not light
        if self.waiters:
            self._hand_over()
        if kind is None or self.tolerance <= 0:
            return
        now = time.monotonic()
        latency = self.kinds.get(kind)
        if latency is None:
            latency = self.kinds[kind] = KindLatency()
        if latency.least:
            self._latency += seconds
            self._unqueued += latency.least
            self._answers += 1
        latency.add(seconds, now)
        if now >= self._interval_end and self._answers >= MIN_ANSWERS:
            self.adjust(now)

    def adjust(self, now: float) -> None:
        """End of an interval: move the limit by what it showed."""
        self.slowdown = self._latency / self._unqueued
        if self.slowdown > self.tolerance:  # cut by a quarter, or in proportion to the excess if it is larger
            cut = max(MAX_DECREASE, min(DECREASE, self.tolerance / self.slowdown))
            self.limit = max(self.floor, int(self.limit * cut))
        elif self._constrained:
            self.limit = min(self.ceiling, self.limit + max(1, int(self.limit * INCREASE)))
        self._latency = self._unqueued = 0.0
        self._answers, self._constrained = 0, False
        self._interval_end = now + INTERVAL_S
