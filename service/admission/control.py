"""Admission control: admit what the engines can serve well, refuse the rest early and say when to come back.

Each engine has a gate (a concurrency limit sized from its worker threads, and a short FIFO queue): a request that
finds the queue full, or waits past SWITCHYARD_QUEUE_WAIT_MS or its deadline, gets 503 with Retry-After unrun.
Deadlines (X-Request-Timeout or SWITCHYARD_REQUEST_TIMEOUT_S) also bound the engine call and PostgreSQL statements.
Per-principal token buckets bound requests and engine-seconds per second (429); a circuit breaker per resident
engine lets `auto` route around one that keeps failing. Domain managers see this module only as an object with
slot(), cooling(), failed() and succeeded(), so they stay free of service/. More: docs/operations.md#overload.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Hashable

from service.admission import pressure
from service.admission.deadlines import deadline as current_deadline
from service.admission.deadlines import set_deadline
from service.admission.loop_lag import LoopLag
from service.admission.pressure import ClassLimit, class_limits
from service.errors import BadRequest, ProblemError
from service.http.jsonnum import decimal
from service.process.devices import is_out_of_memory

PRINCIPAL: ContextVar[str] = ContextVar("switchyard_principal", default="anonymous")
TIMEOUT_HEADER = b"x-request-timeout"
MAX_TIMEOUT_S = 3600.0
POSTGRES_ENGINES = frozenset({"pgvector", "postgis", "postgres", "writes"})  # their failures are the database's


class Shed(ProblemError):
    """Refused before running, to keep the service responsive: nothing was done, retry after Retry-After."""

    status, slug, title = 503, "overloaded", "Overloaded"

    def __init__(self, detail: str, retry_after_s: float, **extra: Any) -> None:
        seconds = max(1, math.ceil(retry_after_s))
        super().__init__(detail, headers={"Retry-After": str(seconds)}, retry_after_s=seconds, **extra)


class QueueDeadline(Shed):
    slug, title = "deadline-exceeded", "Deadline exceeded"


class CoolingDown(Shed):
    slug, title = "engine-cooling-down", "Engine cooling down"


class OverQuota(Shed):
    status, slug, title = 429, "quota-exceeded", "Quota exceeded"


class DeadlineExceeded(ProblemError):
    """The request ran past its deadline inside an engine: its answer was given up and nothing was acknowledged
    (PostgreSQL, DuckDB and the CPU spatial joins stop the work; a call on a thread that cannot be stopped ends by
    itself)."""

    status, slug, title = 504, "deadline-exceeded", "Deadline exceeded"


def loop_lag_of(admission: Any) -> LoopLag:
    """The event loop's lag gate of a process (the engine's, a front's), from the admission settings."""
    return LoopLag(admission.loop_lag_target_ms / 1000 if admission.enabled else 0.0)


def behind(loop_lag: LoopLag, whose: str) -> Shed:
    """The refusal of a request that is one of the share refused while `whose` event loop runs behind."""
    return Shed(f"{whose} event loop has run behind the requests waiting in its sockets (now "
                f"{loop_lag.lag_s * 1000:.1f} ms, SWITCHYARD_LOOP_LAG_TARGET_MS): {loop_lag.share:.0%} of new requests "
                "are refused until it keeps up; this request was not run", 1.0, reason="loop_lag")


def parse_timeout(value: bytes | str) -> float:
    seconds = decimal(value.decode("latin-1") if isinstance(value, bytes) else value)
    if not 0 < seconds <= MAX_TIMEOUT_S:  # nan fails too
        raise BadRequest(f"must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]", field="X-Request-Timeout")
    return seconds


def principal_of(verified_key: bytes | None, client: tuple[str, int] | None) -> str:
    """Whose quota a request draws on: the API key it was verified to hold (hashed: never kept in clear), or, where
    no key is configured, its client address. Never an unverified Authorization value: each new one would be a
    fresh bucket."""
    if verified_key:
        return "key:" + hashlib.blake2b(verified_key, digest_size=8).hexdigest()
    return "addr:" + (client[0] if client else "unknown")


class Gate:
    """A concurrency limit with a bounded FIFO queue; a freed slot passes straight to the next waiter."""

    def __init__(self, name: str, limit: int, depth: int, max_wait_s: float) -> None:
        self.name, self.limit, self.depth, self.max_wait_s = name, limit, depth, max_wait_s
        self.active = 0
        self.waiters: deque[asyncio.Future] = deque()
        self.service_s = 0.0  # moving average of the time a request holds a slot: Retry-After's estimate

    def retry_after_s(self) -> float:
        return (len(self.waiters) + self.active) / self.limit * max(self.service_s, 0.001)

    async def acquire(self, deadline: float | None) -> None:
        if self.active < self.limit and not self.waiters:
            self.active += 1
            return
        if len(self.waiters) >= self.depth:
            raise Shed(f"engine {self.name} is at capacity ({self.active} running, {len(self.waiters)} queued); "
                       "the request was not run", self.retry_after_s(), engine=self.name, reason="queue_full")
        wait = self.max_wait_s
        by_deadline = deadline is not None and deadline - time.monotonic() < wait
        if by_deadline and deadline is not None:  # (by_deadline implies the latter)
            wait = deadline - time.monotonic()
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            if wait > 0:
                await asyncio.wait((waiter,), timeout=wait)  # wait() leaves the future alone when it times out
        except BaseException:  # cancelled (the client went away): give back a slot handed over meanwhile
            self._leave(waiter)
            raise
        if waiter.done():
            return  # release() handed its slot over: active already counts it
        self._leave(waiter)
        if by_deadline:
            raise QueueDeadline(f"the request's deadline passed while it waited for engine {self.name}; it was not "
                                "run", self.retry_after_s(), engine=self.name, reason="deadline")
        raise Shed(f"engine {self.name} is at capacity: the request waited {self.max_wait_s * 1000:.0f} ms in its "
                   "queue and was not run", self.retry_after_s(), engine=self.name, reason="queue_wait")

    def _leave(self, waiter: asyncio.Future) -> None:
        if waiter.done() and not waiter.cancelled():
            self.release()  # it was handed a slot it will not use
            return
        waiter.cancel()
        try:
            self.waiters.remove(waiter)
        except ValueError:
            pass

    def release(self, held_s: float | None = None) -> None:
        if held_s is not None:
            self.service_s = held_s if self.service_s == 0 else 0.9 * self.service_s + 0.1 * held_s
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1


class Unbounded:
    """try_slot's slot with admission control off."""

    def release(self, held_s: float | None = None) -> None:
        pass


UNBOUNDED = Unbounded()


@dataclass
class TokenBucket:
    rate: float  # tokens per second
    burst: float
    tokens: float
    at: float = field(default_factory=time.monotonic)

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self, amount: float, now: float) -> float:
        """Take `amount` if the bucket holds it: 0; else the seconds until it will (nothing is taken)."""
        self._refill(now)
        if self.tokens >= amount:
            self.tokens -= amount
            return 0.0
        return (amount - self.tokens) / self.rate

    def charge(self, amount: float, now: float) -> None:
        """Take what was spent, known only afterwards (engine-seconds): the balance may go below zero."""
        self._refill(now)
        self.tokens -= amount

    def wait_s(self, now: float) -> float:
        """Seconds until the balance is positive again (0: it is)."""
        self._refill(now)
        return 0.0 if self.tokens > 0 else (1e-3 - self.tokens) / self.rate


    def full(self, now: float) -> bool:
        """Whether it has refilled to its burst: then it is the same as a new bucket."""
        return self.tokens + (now - self.at) * self.rate >= self.burst


MAX_PRINCIPALS = 10_000  # buckets kept per quota; past it new principals share one bucket
OVERFLOW = "overflow"
SWEEP_EVERY_S = 1.0


class Buckets:
    """One quota's token buckets by principal, bounded: a bucket back at its burst is the same as a new one, so the
    buckets idle long enough to refill are dropped (swept at most once a second); while the table is still at
    `max_size`, a new principal draws on one shared overflow bucket, never on a fresh one of its own."""

    def __init__(self, rate: float, burst: float, max_size: int = MAX_PRINCIPALS) -> None:
        self.rate, self.burst, self.max_size = rate, burst, max_size
        self.table: dict[str, TokenBucket] = {}
        self.swept = time.monotonic()

    def __len__(self) -> int:
        return len(self.table)

    def get(self, principal: str, now: float) -> TokenBucket:
        bucket = self.table.get(principal)
        if bucket is not None:
            return bucket
        if now - self.swept >= SWEEP_EVERY_S:
            self.swept = now
            self.table = {p: b for p, b in self.table.items() if not b.full(now)}
        if len(self.table) >= self.max_size:
            principal = OVERFLOW
            if (bucket := self.table.get(principal)) is not None:
                return bucket
        bucket = self.table[principal] = TokenBucket(self.rate, self.burst, tokens=self.burst, at=now)
        return bucket


@dataclass
class Breaker:
    failures: int = 0
    open_until: float = 0.0  # 0: closed
    probe_at: float = 0.0  # when the last probe after a cool-down was let through
    out_of_memory: bool = False  # opened by an out-of-memory failure rather than by failures in a row

    def why(self) -> str:
        return "running out of memory" if self.out_of_memory else f"{self.failures} failures in a row"


class Admission:
    """Gates, quotas and breakers of one process (see the module's docstring)."""

    def __init__(self, settings: Any, metrics: Any = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.enabled = settings.admission.enabled
        self.max_wait_s = settings.admission.queue_wait_ms / 1000
        self.limits = engine_limits(settings)
        a = settings.admission
        self.classes = (class_limits(a.max_inflight, a.min_inflight, a.inflight_latency_tolerance, self.max_wait_s)
                        if a.enabled and a.max_inflight else None)  # work class -> its in-flight limit
        self.loop_lag = loop_lag_of(a)  # started by start()
        self.gates: dict[str, Gate] = {}
        self.breakers: dict[str, Breaker] = {}
        rate, seconds_rate = a.quota_requests_per_s, a.quota_engine_seconds_per_s
        self.requests = Buckets(rate, a.quota_burst or max(1.0, 2 * rate))
        self.engine_seconds = Buckets(seconds_rate,
                                      max(seconds_rate, a.quota_engine_seconds_burst or 10 * seconds_rate))

    # -- gates -----------------------------------------------------------------------------------------
    def gate(self, engine: str) -> Gate:
        gate = self.gates.get(engine)
        if gate is None:
            limit = self.limits.get(engine, 4)
            depth = self.settings.admission.queue_depth
            depth = 2 * limit if depth is None else depth
            gate = self.gates[engine] = Gate(engine, limit, depth, self.max_wait_s)
        return gate

    def slot(self, engine: str, bound_run: bool = True) -> "Slot":
        """`async with admission.slot(engine):` around one engine call. With bound_run=False the deadline bounds
        only the wait for a slot, not the call: writes are never cut off between their COMMIT and their ack."""
        return Slot(self, engine, bound_run)

    def try_slot(self, engine: str) -> "Gate | Unbounded | None":
        """A slot of `engine` now, for a call that runs at once on the event loop, or None where slot() could
        have to wait, refuse, charge a quota or bound the call by a deadline (the caller then takes that path).
        The caller gives it back with `.release(held_s)` (None: the call did not run)."""
        if not self.enabled:
            return UNBOUNDED
        if (self.open_breaker(engine) is not None or self.settings.admission.quota_engine_seconds_per_s
                or current_deadline() is not None):
            return None
        gate = self.gate(engine)
        if gate.active >= gate.limit or gate.waiters:
            return None
        gate.active += 1
        if self.metrics is not None:
            self.metrics.admitted(engine)
        return gate

    def shed(self, engine: str, reason: str, count: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.shed(engine, reason, count)

    # -- requests --------------------------------------------------------------------------------------
    def begin(self, deadline: float | None, principal: str | None) -> None:
        """What a request carries through this process (its task): its deadline, and the principal whose request
        quota it is counted against (429 past it). None: no deadline; no principal named (no quota)."""
        if deadline is not None:
            set_deadline(deadline)
        if principal is not None:
            PRINCIPAL.set(principal)
            self.check_request(principal)

    def enter_now(self, work: str) -> Ticket | None:
        """A slot under the work class's in-flight limit now, or None where enter() would have to wait."""
        if self.classes is None:
            return Ticket(None)
        limit = self.classes[work]
        return Ticket(limit) if limit.admit() else None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the event loop's lag from now on (service/admission/loop_lag.py), with admission control on."""
        if self.enabled:
            self.loop_lag.start(loop)

    def stop(self) -> None:
        self.loop_lag.stop()

    def crowded(self) -> bool:
        """Whether the loop is behind or any work class has all its slots taken (only then can check_room
        refuse)."""
        return bool(self.loop_lag.share) or (self.classes is not None
                                             and any(c.inflight >= c.limit for c in self.classes.values()))

    def check_room(self, work: str, kind: Hashable = None, screened: bool = False) -> None:
        """Refuse (Shed, 503) a request of `work` and `kind` at once, before its body is read, when its class would
        (no free slot and a full queue: service/admission/pressure.py) or it is one of the share refused while the
        event loop runs behind (check_loop; `screened`: it was counted there already)."""
        if not screened:
            self.check_loop()
        if self.classes is not None and self.classes[work].full(kind):
            raise self._no_slot(work)

    def check_loop(self) -> None:
        """Refuse (Shed, 503) the request arriving now if it is one of the share refused while the event loop runs
        behind (service/admission/loop_lag.py); each call counts as one request."""
        self.loop_lag.arrive()
        if self.loop_lag.refuse_next():
            self.shed("requests", "loop_lag")
            raise behind(self.loop_lag, "the service's")

    def queue_now(self, work: str, kind: Hashable = None) -> "Queued":
        """For a request that found no slot (enter_now): its place in its class's queue, taken now, before its task
        starts (so that the requests read in one turn of the event loop count against the queue's depth); Shed
        (503) where the queue is full. The place is awaited with `Queued.wait` or given up with `abandon`."""
        assert self.classes is not None  # enter_now found no slot: there are classes
        limit = self.classes[work]
        handed = limit.enqueue(kind)
        if handed is None:
            raise self._no_slot(work)
        return Queued(limit, handed, work, kind)

    async def enter(self, work: str, kind: Hashable = None) -> Ticket:
        """A slot under the in-flight limit of `work`'s class (service/admission/pressure.py), now or after a short
        wait (bounded by what `kind` costs); Shed (503) when none comes."""
        if self.classes is None:
            return Ticket(None)
        limit = self.classes[work]
        if not await limit.enter(kind):
            raise self._no_slot(work)
        return Ticket(limit)

    def _no_slot(self, work: str) -> Shed:
        assert self.classes is not None
        self.shed("requests", "inflight")
        return Shed(f"the service is serving {self.classes[work].inflight} {work} requests, the limit of that work "
                    "class under the present load (SWITCHYARD_MAX_INFLIGHT, SWITCHYARD_INFLIGHT_LATENCY_TOLERANCE), "
                    "and no slot came free in time; this one was not run", 1.0, reason="inflight", work_class=work)

    # -- quotas ----------------------------------------------------------------------------------------
    def check_request(self, principal: str) -> None:
        """Count one request against the principal's request bucket; 429 past it."""
        rate = self.requests.rate
        if not rate:
            return
        now = time.monotonic()
        wait = self.requests.get(principal, now).take(1.0, now)
        if wait:
            self.shed("requests", "quota")
            raise OverQuota(f"more than {rate:g} requests per second for this API key or client", wait, reason="quota")

    def _engine_bucket(self, principal: str) -> TokenBucket | None:
        if not self.engine_seconds.rate:
            return None
        return self.engine_seconds.get(principal, time.monotonic())

    # -- breakers --------------------------------------------------------------------------------------
    def open_breaker(self, engine: str) -> Breaker | None:
        """The engine's breaker while it is open (the engine is cooling down), else None."""
        breaker = self.breakers.get(engine)
        return breaker if breaker is not None and breaker.open_until and time.monotonic() < breaker.open_until else None

    def cooling(self, engine: str) -> str | None:
        """Why `auto` should route around this engine now, or None. After the cool-down one request probes it."""
        breaker = self.breakers.get(engine)
        if breaker is None or breaker.open_until == 0.0:
            return None
        now = time.monotonic()
        if now < breaker.open_until or now - breaker.probe_at < self.settings.admission.breaker_cooldown_s:
            return f"is cooling down after {breaker.why()}"
        breaker.probe_at = now  # this caller is the probe; another may go one cool-down later
        return None

    def failed(self, engine: str, exc: BaseException | None = None) -> None:
        """An engine call failed. Out of memory (GPU or host) opens the breaker at once: retrying into a full
        device only fails again, and the cool-down lets what held the memory finish."""
        if engine in POSTGRES_ENGINES:  # the database supervisor (service/database/supervisor.py) watches those
            return
        breaker = self.breakers.setdefault(engine, Breaker())
        breaker.failures += 1
        if exc is not None and is_out_of_memory(exc):
            breaker.failures = max(breaker.failures, self.settings.admission.breaker_failures)
            breaker.out_of_memory = True
        if breaker.failures >= self.settings.admission.breaker_failures:
            breaker.open_until = time.monotonic() + self.settings.admission.breaker_cooldown_s
            if self.metrics is not None:
                self.metrics.breaker_open.labels(engine).set(1)

    def succeeded(self, engine: str) -> None:
        breaker = self.breakers.get(engine)
        if breaker is not None and (breaker.failures or breaker.open_until):
            self.breakers.pop(engine)
            if self.metrics is not None:
                self.metrics.breaker_open.labels(engine).set(0)


class Ticket:
    """One request's slot under its work class's in-flight limit, given back once with how it went."""

    __slots__ = ("limit", "started")

    def __init__(self, limit: ClassLimit | None) -> None:
        self.limit, self.started = limit, time.perf_counter()

    def leave(self, kind: Hashable = None) -> float:
        """Give the slot back; `kind` (what the request was) when it succeeded, whose latency moves the limit
        (failures say nothing of queueing). Returns the seconds since entry."""
        seconds = time.perf_counter() - self.started
        if self.limit is not None:
            self.limit.leave(kind, seconds)
        return seconds


class Queued:
    """A request's place in its work class's queue, taken before its task started (Admission.queue_now)."""

    __slots__ = ("limit", "handed", "work", "kind", "since", "settled")

    def __init__(self, limit: ClassLimit, handed: asyncio.Future, work: str, kind: Hashable) -> None:
        self.limit, self.handed, self.work, self.kind = limit, handed, work, kind
        self.since, self.settled = pressure.monotonic(), False

    async def wait(self, admission: "Admission") -> Ticket:
        """The slot, once handed over within the kind's wait (counted from when the place was taken); Shed (503)
        when none comes."""
        self.settled = True
        if not await self.limit.wait_queued(self.handed, self.kind, self.since):
            raise admission._no_slot(self.work)
        return Ticket(self.limit)

    def abandon(self) -> None:
        """Give the place (or a slot handed to it) back, unless wait() took it over."""
        if not self.settled:
            self.settled = True
            self.limit.abandon(self.handed)


class Slot:
    """One engine call's place in its gate, the engine-seconds it costs, and its deadline."""

    __slots__ = ("admission", "bound_run", "bucket", "engine", "gate", "started", "timeout")

    def __init__(self, admission: Admission, engine: str, bound_run: bool = True) -> None:
        self.admission, self.engine, self.bound_run = admission, engine, bound_run
        self.gate: Gate | None = None
        self.bucket: TokenBucket | None = None  # the principal's engine-seconds, charged on exit
        self.timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        a = self.admission
        deadline = current_deadline()
        if not a.enabled:
            self.started = time.monotonic()
            return
        if (breaker := a.open_breaker(self.engine)) is not None:
            a.shed(self.engine, "cooling_down")
            raise CoolingDown(f"engine {self.engine} is cooling down after {breaker.why()}; the request was not run",
                              breaker.open_until - time.monotonic(), engine=self.engine, reason="cooling_down")
        self.bucket = bucket = a._engine_bucket(PRINCIPAL.get())
        if bucket is not None and (wait := bucket.wait_s(time.monotonic())) > 0:
            a.shed(self.engine, "quota")
            raise OverQuota("this API key or client has used its engine-seconds quota "
                            f"({a.settings.admission.quota_engine_seconds_per_s:g} per second)", wait, reason="quota")
        if deadline is not None and deadline <= time.monotonic():
            a.shed(self.engine, "deadline")
            raise QueueDeadline("the request's deadline passed before it reached an engine; it was not run", 1.0,
                                engine=self.engine, reason="deadline")
        gate = a.gate(self.engine)
        try:
            await gate.acquire(deadline)
        except Shed as exc:
            a.shed(self.engine, exc.extra.get("reason", "queue_full"))
            raise
        self.gate = gate
        self.started = time.monotonic()
        if a.metrics is not None:
            a.metrics.admitted(self.engine)
        if deadline is not None and self.bound_run:
            self.timeout = asyncio.timeout_at(asyncio.get_running_loop().time() + (deadline - self.started))
            await self.timeout.__aenter__()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        held = time.monotonic() - self.started
        expired = False
        if self.timeout is not None:
            try:
                await self.timeout.__aexit__(kind, exc, tb)
            except TimeoutError:
                expired = True
        if self.gate is not None:
            self.gate.release(held)
        if self.bucket is not None:
            self.bucket.charge(held, time.monotonic())
        if expired:
            self.admission.shed(self.engine, "deadline_running")
            raise DeadlineExceeded(f"the request's deadline passed while engine {self.engine} ran it; its answer "
                                   "was given up, and the engine stops the work where it can (a write is "
                                   "acknowledged only by a 2xx answer)", field="X-Request-Timeout")
        return False


def engine_limits(settings: Any) -> dict[str, int]:
    """How many requests each engine runs at once: its worker threads (the domain managers' executors), times one
    micro-batch for the resident vector engines, whose requests share engine calls."""
    pool = settings.database.pool_max
    return {
        "faiss": 2 * settings.vectors.batch_max, "cuvs": settings.vectors.batch_max,
        "cupy": settings.vectors.batch_max,
        "pgvector": max(1, pool // 2), "writes": 4 * pool,
        "duckdb": 4, "cudf": 1, "postgres": max(1, settings.database.sql_pool_max),
        "cpu-spatial": 1, "cuda-spatial": 1, "postgis": max(1, pool // 4),
        "recall": 1,  # the vector managers' one heavy thread (indexes/manager_state.py)
    }
