"""In-flight limits by work class, following the latency of what each admits: serve promptly, refuse the rest.

Requests are sorted into work classes (light reads and searches, writes, heavy analytics, jobs: see WORK_SHARES),
each with its own limit and FIFO queue, so no class ever waits behind another's backlog. As TCP Vegas does, a
limit is cut while a class's answered requests take more than `tolerance` times their unqueued latency (per kind
of request: the least mean of FOUR consecutive answers over WINDOW_S): the limit of the lowest class running beside
it, while one is above its floor (what slows light work is the heavy work sharing its cores), else its own, but
only if the class used at least half of it in that interval (as Netflix's Vegas limit: a class that leaves most of
its limit unused is not queueing on it, so its latency says nothing of the limit; on a noisy machine a lone client's
jitter cut an idle limit to its floor, and a burst was then refused with capacity free). A
limit grows by a tenth while its class's requests are not slowed and had to wait; once a class's load is gone
(under half its limit in use, no cut for RECOVER_S) its limit doubles every RECOVER_S back to its ceiling. A request
that finds its class full waits in the queue for at most WAIT_FACTOR times its kind's
unqueued latency (between MIN_WAIT_S and `max_wait_s`), so that waiting at most doubles what it costs; a free slot
goes to the head of the queue at once. The queue holds only the waiters a slot can reach within that wait (the
slots, times the wait over the mean time a slot is held; at most two per slot): a request that would wait in vain is
refused at once, before its body is read (full(): the cheapest refusal, which the HTTP protocol answers without an
ASGI cycle, and which keeps a process that refuses most of what it is sent serving the rest at its capacity; a
refusal after a wait cost as much as an answer). Why: docs/design/serving.md.
"""

from __future__ import annotations

import asyncio
from collections import deque
from time import monotonic
from typing import Hashable

INTERVAL_S = 0.1  # the limit moves at most this often ...
MIN_ANSWERS = 8  # ... and only on this many answers
WINDOW_S = 10.0  # how long an unqueued latency is remembered
FOUR = 4  # answers averaged into one sample of a kind's latency
DECREASE = 0.75
MAX_DECREASE = 0.25  # the most one interval cuts: to a quarter
INCREASE = 0.1
RECOVER_S = 1.0  # with its load gone, a class's limit doubles this often
WAIT_FACTOR = 1.0  # a waiter waits at most this many times its kind's unqueued latency ...
MIN_WAIT_S = 0.001  # ... but at least this long
MAX_KINDS = 1024  # kinds whose latency is remembered, per class
HOLD_WEIGHT = 0.05  # weight of each request in the moving mean of the time a slot is held

# Work classes in order of priority, and their share of SWITCHYARD_MAX_INFLIGHT (ceiling) and SWITCHYARD_MIN_INFLIGHT
# (floor).
LIGHT, WRITE, HEAVY, JOB = "light", "write", "heavy", "job"
WORK_SHARES = {LIGHT: 1.0, WRITE: 0.5, HEAVY: 0.25, JOB: 0.125}


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


class ClassLimit:
    """One work class's adaptive in-flight limit and its queue (see the module's docstring)."""

    def __init__(self, name: str, ceiling: int, floor: int, tolerance: float, max_wait_s: float) -> None:
        self.name = name
        self.ceiling = max(1, ceiling)
        self.floor = max(1, min(floor, self.ceiling))
        self.tolerance = tolerance  # 0: a fixed limit of `ceiling`
        self.max_wait_s = max_wait_s
        self.limit = self.ceiling  # generous until latency says otherwise
        self.inflight = 0
        self.waiters: deque[asyncio.Future] = deque()  # result True: handed a slot
        self.slowdown = 0.0  # of the last interval: latency over unqueued latency
        self.hold_s = 0.0  # moving mean of the time a slot is held (0: none yet)
        self.kinds: dict[Hashable, KindLatency] = {}
        self.lower: list[ClassLimit] = []  # the classes of lower priority, highest first (class_limits)
        now = monotonic()
        self._interval_end = now + INTERVAL_S
        self._steady_since = now  # the last cut or recovery step
        self._latency = self._unqueued = 0.0
        self._answers = 0
        self._constrained = False  # whether a request had to wait or was refused in this interval
        self._peak = 0  # the most requests in flight at once in this interval

    def current(self) -> int:
        """The limit in force, recovered first if the class's load is gone."""
        if self.limit < self.ceiling and self.inflight < self.limit / 2:
            now = monotonic()
            if (steps := int((now - self._steady_since) / RECOVER_S)) > 0:
                self.limit = min(self.ceiling, self.limit << min(steps, 32))
                self._steady_since = now
                self._hand_over()
        return self.limit

    def admit(self) -> bool:
        """A slot now, if one is free and nobody waits for one."""
        if not self.waiters and self.inflight < self.current():
            self._take_slot()
            return True
        self._constrained = True
        return False

    def wait_s(self, kind: Hashable) -> float:
        """The longest a request of `kind` waits for a slot: a few times what it costs unqueued, when known."""
        latency = self.kinds.get(kind)
        if latency is None or not latency.least:
            return self.max_wait_s
        return min(self.max_wait_s, max(MIN_WAIT_S, WAIT_FACTOR * latency.least))

    def full(self, kind: Hashable = None) -> bool:
        """Whether a request of `kind` arriving now would be refused at once: no free slot and a full queue."""
        return self.inflight >= self.current() and self._queue_full(kind)

    def _queue_full(self, kind: Hashable) -> bool:
        """Whether a newcomer of `kind` would wait in vain: as many wait as the slots can take within its wait."""
        depth = 2 * self.limit
        if self.hold_s > 0:  # each slot frees about once per hold_s: that many per slot within the wait, at least 1
            depth = min(depth, max(1, int(self.limit * self.wait_s(kind) / self.hold_s)))
        return len(self.waiters) >= depth

    async def enter(self, kind: Hashable = None) -> bool:
        """A slot, now or after a wait in the queue; False: refused (the queue is full, or no slot came in time)."""
        if self.admit():
            return True
        handed = self.enqueue(kind)
        return handed is not None and await self.wait_queued(handed, kind, monotonic())

    def enqueue(self, kind: Hashable = None) -> asyncio.Future | None:
        """A place at the back of the queue, taken now (from a protocol callback: the request's task, which awaits
        it with wait_queued, starts later, and places taken meanwhile count against the queue's depth), or None
        where the queue is full. Whoever takes a place gives it up with wait_queued or abandon."""
        if self._queue_full(kind):
            return None
        handed = asyncio.get_running_loop().create_future()
        self.waiters.append(handed)
        return handed

    async def wait_queued(self, handed: asyncio.Future, kind: Hashable, since: float) -> bool:
        """Wait in the place taken at `since` (monotonic) for a slot, at most `kind`'s wait from then; False: none
        came (the place is given up)."""
        try:
            if not handed.done():
                await asyncio.wait((handed,), timeout=max(0.0, self.wait_s(kind) - (monotonic() - since)))
        except BaseException:  # cancelled (the client went away): give back a slot handed over meanwhile
            self.abandon(handed)
            raise
        if handed.done():
            return True  # _hand_over counted it in
        self.abandon(handed)
        return False

    def abandon(self, handed: asyncio.Future) -> None:
        """Give up a place in the queue, or the slot it was handed."""
        if handed.done() and not handed.cancelled():
            self.leave()  # handed a slot it will not use
            return
        handed.cancel()
        try:
            self.waiters.remove(handed)
        except ValueError:
            pass

    def _hand_over(self) -> None:
        """Give free slots to the waiters at the head of the queue."""
        while self.waiters and self.inflight < self.limit:
            self._take_slot()
            self.waiters.popleft().set_result(True)

    def _take_slot(self) -> None:
        self.inflight += 1
        self._peak = max(self._peak, self.inflight)

    def leave(self, kind: Hashable = None, seconds: float = 0.0) -> None:
        """Count one request out; `kind` and its latency if it succeeded (failures say nothing of queueing: many
        are refusals that took no time)."""
        self.inflight -= 1
        if self.waiters:
            self._hand_over()
        if seconds > 0:
            self.hold_s = seconds if not self.hold_s else self.hold_s + HOLD_WEIGHT * (seconds - self.hold_s)
        if kind is None or self.tolerance <= 0:
            return
        now = monotonic()
        latency = self.kinds.get(kind)
        if latency is None:
            if len(self.kinds) >= MAX_KINDS:
                return
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
            # Lower classes running beside this one are what slows it, if any is above its floor: cut the lowest.
            # Else its own limit, if it was in use: half of it or more in flight at once in this interval.
            victim = next((c for c in reversed(self.lower) if c.inflight and c.limit > c.floor), None)
            if victim is None and 2 * self._peak >= self.limit:
                victim = self
            if victim is not None:
                victim.limit = max(victim.floor, int(victim.limit * cut))
                victim._steady_since = now
        elif self._constrained:
            self.limit = min(self.ceiling, self.limit + max(1, int(self.limit * INCREASE)))
            self._hand_over()
        self._latency = self._unqueued = 0.0
        self._answers, self._constrained, self._peak = 0, False, self.inflight
        self._interval_end = now + INTERVAL_S


def class_shares(total: int) -> dict[str, int]:
    """Each work class's share of a process's limit (SWITCHYARD_MAX_INFLIGHT) or floor (SWITCHYARD_MIN_INFLIGHT)."""
    return {name: max(1, int(total * share)) for name, share in WORK_SHARES.items()}


def class_limits(ceiling: int, floor: int, tolerance: float, max_wait_s: float) -> dict[str, ClassLimit]:
    """One ClassLimit per work class, sized by its share of the process's ceiling and floor; each knows the classes
    below it (WORK_SHARES is in order of priority)."""
    ceilings, floors = class_shares(ceiling), class_shares(floor)
    classes = {name: ClassLimit(name, ceilings[name], floors[name], tolerance, max_wait_s) for name in WORK_SHARES}
    ordered = list(classes.values())
    for i, work in enumerate(ordered):
        work.lower = ordered[i + 1:]
    return classes
