"""Prometheus metrics: HTTP requests per route and status, and per-engine query counts and latency.

Each app owns its registry, so tests can build many apps in one process.

Requests and engine calls are counted per label set in a Tally: plain numbers, folded into the Prometheus children
at each scrape. prometheus_client takes a lock and makes three Python calls per update, and a search made eight
updates: about a tenth of the service's CPU per search on the hot path. Tallies are updated and folded on the event
loop's thread only (every caller of observe, observe_request and admitted is async code); the text is then made on
a worker thread (render), since prometheus_client takes 15-30 us a line and a scrape of a few hundred
lines held the loop, and every search behind it, for 4-6 ms.
"""

from __future__ import annotations

import asyncio
import os
import time
from bisect import bisect_left
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.http.access_log import log_request

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._tallies: list[Tally] = []
        self._gate_collectors: list[_GateCollector] = []  # collectors whose values are read on the event loop
        self.http_requests = Counter(
            "switchyard_http_requests_total", "HTTP requests by route template, method and status.",
            ["route", "method", "status"], registry=self.registry,
        )
        self.http_latency = Histogram(
            "switchyard_http_request_duration_seconds", "HTTP request latency by route template, method and status.",
            ["route", "method", "status"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._in_protocol = self._tally(Counter(
            "switchyard_express_protocol_searches_total", "Searches answered from the HTTP protocol itself, without an "
            "ASGI cycle "
            "(service/http/express_protocol.py); also counted in switchyard_http_requests_total.",
            registry=self.registry,
        ))
        self.engine_queries = Counter(
            "switchyard_engine_queries_total", "Engine calls by engine, operation and outcome.",
            ["domain", "engine", "operation", "outcome"], registry=self.registry,
        )
        self.engine_latency = Histogram(
            "switchyard_engine_query_duration_seconds", "Engine call latency by engine and operation.",
            ["domain", "engine", "operation"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.engine_available = Gauge(
            "switchyard_engine_available", "1 if the engine can run on this machine.",
            ["domain", "engine", "kind"], registry=self.registry,
        )
        self.engine_ready = Gauge(
            "switchyard_engine_ready", "1 if the engine has its data loaded.",
            ["domain", "engine", "kind"], registry=self.registry,
        )

        self.database_up = Gauge("switchyard_database_up", "1 while PostgreSQL answers.", registry=self.registry)
        self.database_reconnects = Counter(
            "switchyard_database_reconnects_total", "Times PostgreSQL answered again after being unreachable.",
            registry=self.registry)
        self.database_restarts = Counter(
            "switchyard_database_restarts_total", "Restarts of the embedded PostgreSQL after it died.",
            registry=self.registry)

        self.replication_lag = Histogram(
            "switchyard_replication_lag_seconds",
            "From a commit in PostgreSQL to its change applied in this process's resident replica "
            "(commits read from the change log; this process's own writes are applied before their ack).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0),
            registry=self.registry,
        )

        self.admitted_total = Counter(
            "switchyard_admitted_total", "Requests admitted to an engine by admission control.", ["engine"],
            registry=self.registry)
        self.shed_total = Counter(
            "switchyard_shed_total", "Requests refused by admission control, by engine and reason (queue_full, "
            "queue_wait, deadline, deadline_running, quota, cooling_down, inflight, loop_lag (the engine's loop or a "
            "front process's); throttled: by a front process while its engine refused such calls; engine 'requests' "
            "for quotas and in-flight limits).",
            ["engine", "reason"], registry=self.registry)
        self.breaker_open = Gauge(
            "switchyard_engine_breaker_open", "1 while `auto` routes around an engine that kept failing.", ["engine"],
            registry=self.registry)
        self._admitted_children: dict[str, Tally] = {}

        self._http_children: dict[tuple[str, str, int], Tally] = {}
        self._engine_children: dict[tuple[str, str, str, bool], Tally] = {}
        self._shed_children: dict[tuple[str, str], Tally] = {}

    def _tally(self, counter: Any, histogram: Any = None) -> "Tally":
        tally = Tally(counter, histogram)
        self._tallies.append(tally)
        return tally

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count and time one HTTP request."""
        key = (route, method, status)
        tally = self._http_children.get(key)
        if tally is None:
            labels = (route, method, str(status))
            tally = self._http_children[key] = self._tally(self.http_requests.labels(*labels),
                                                           self.http_latency.labels(*labels))
        tally.add(seconds)

    @contextmanager
    def engine_call(self, domain: str, engine: str, operation: str) -> Iterator[None]:
        """Time one engine call; the outcome is 'ok' or 'error'."""
        start = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.observe(domain, engine, operation, time.perf_counter() - start, ok)

    def observe(self, domain: str, engine: str, operation: str, seconds: float, ok: bool) -> None:
        key = (domain, engine, operation, ok)
        tally = self._engine_children.get(key)
        if tally is None:
            tally = self._engine_children[key] = self._tally(
                self.engine_queries.labels(domain, engine, operation, "ok" if ok else "error"),
                self.engine_latency.labels(domain, engine, operation))
        tally.add(seconds)

    def admitted(self, engine: str) -> None:
        tally = self._admitted_children.get(engine)
        if tally is None:
            tally = self._admitted_children[engine] = self._tally(self.admitted_total.labels(engine))
        tally.add()

    def answered_in_protocol(self) -> None:
        """One search answered inline by the HTTP protocol (express)."""
        self._in_protocol.add()

    def shed(self, engine: str, reason: str, count: int = 1) -> None:
        """`count` requests refused unrun (a process under overload counts thousands a second: a Tally, as
        admitted)."""
        tally = self._shed_children.get((engine, reason))
        if tally is None:
            tally = self._shed_children[(engine, reason)] = self._tally(self.shed_total.labels(engine, reason))
        tally.n += count

    def watch_gates(self, gates: Callable[[], dict[str, Any]], classes: Any = None, loop_lag: Any = None) -> None:
        """Report each engine gate's running and queued requests and limit, the process's in-flight limit
        (service/admission/pressure.py: work class -> its limit) and its event loop's lag (loop_lag.py), at every
        scrape."""
        collector = _GateCollector(gates, classes, loop_lag)
        self._gate_collectors.append(collector)
        self.registry.register(collector)

    async def render(self) -> bytes:
        """The exposition text: the tallies folded on the event loop, the text made on a worker thread, so a scrape
        delays searches by a GIL switch interval at most rather than by the whole render."""
        self._fold()
        return await asyncio.to_thread(generate_latest, self.registry)

    def _fold(self) -> None:
        """What must run on the event loop before the text is made: tallies folded, gauges of live state read."""
        for tally in self._tallies:
            tally.fold()
        for collector in self._gate_collectors:
            collector.snapshot()


class Tally:
    """A counter child and, optionally, a histogram child of one label set, recorded as plain numbers until fold()
    adds them to the children (see the module's docstring)."""

    __slots__ = ("counter", "histogram", "bounds", "counts", "n", "total")

    def __init__(self, counter: Any, histogram: Any = None) -> None:
        self.counter, self.histogram = counter, histogram
        # prometheus_client's Histogram keeps these (upper bounds ending with +Inf, one value per bucket, the sum);
        # a value goes into the first bucket whose bound it does not exceed, as observe() places it.
        self.bounds = histogram._upper_bounds if histogram is not None else ()
        self.counts = [0] * len(self.bounds)
        self.n, self.total = 0, 0.0

    def add(self, seconds: float = 0.0) -> None:
        self.n += 1
        if self.bounds:
            self.total += seconds
            self.counts[bisect_left(self.bounds, seconds)] += 1

    def fold(self) -> None:
        n, self.n = self.n, 0
        if not n:
            return
        self.counter.inc(n)
        if self.histogram is not None:
            counts, self.counts, total, self.total = self.counts, [0] * len(self.bounds), self.total, 0.0
            for bucket, count in zip(self.histogram._buckets, counts):
                if count:
                    bucket.inc(count)
            self.histogram._sum.inc(total)


class _GateCollector(Collector):
    """Admission's gauges, read on the event loop (snapshot: ClassLimit.current() may hand a slot over, which
    resolves a waiter's future) and yielded from there by collect(), on whichever thread makes the text."""

    def __init__(self, gates: Callable[[], dict[str, Any]], classes: Any, loop_lag: Any) -> None:
        self.gates, self.classes, self.loop_lag = gates, classes, loop_lag
        self.families: list[GaugeMetricFamily] = []

    def snapshot(self) -> None:
        self.families = list(self._read())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return iter(self.families)

    def _read(self) -> Iterator[GaugeMetricFamily]:
        queued = GaugeMetricFamily("switchyard_engine_queue_depth", "Requests waiting for an engine slot.",
                                   labels=["engine"])
        running = GaugeMetricFamily("switchyard_engine_running", "Requests holding an engine slot.", labels=["engine"])
        limit = GaugeMetricFamily("switchyard_engine_concurrency_limit", "Engine slots (admission control).",
                                  labels=["engine"])
        for name, gate in self.gates().items():
            queued.add_metric([name], len(gate.waiters))
            running.add_metric([name], gate.active)
            limit.add_metric([name], gate.limit)
        yield from (queued, running, limit)
        if self.classes is not None:
            inflight = GaugeMetricFamily("switchyard_inflight", "/v1 requests being served, by work class.",
                                         labels=["work"])
            limit = GaugeMetricFamily("switchyard_inflight_limit", "The in-flight limit in force per work class (it "
                                      "follows the latency of admitted requests).", labels=["work"])
            slowdown = GaugeMetricFamily("switchyard_admitted_slowdown", "Latency of successful /v1 requests over "
                                         "their unqueued latency, in the last interval of the class's in-flight "
                                         "limit.", labels=["work"])
            for name, work in self.classes.items():
                limit.add_metric([name], work.current())
                inflight.add_metric([name], work.inflight)
                slowdown.add_metric([name], work.slowdown)
            yield from (inflight, limit, slowdown)
        if self.loop_lag is not None:
            yield GaugeMetricFamily("switchyard_event_loop_lag_seconds", "How long readable sockets wait for the "
                                    "event loop, standing (the least of its last probes).", value=self.loop_lag.lag_s)
            if self.loop_lag.target_s:
                yield GaugeMetricFamily("switchyard_event_loop_refused_share", "Share of new /v1 requests refused "
                                        "while the event loop runs behind.", value=self.loop_lag.share)


class ReplicationTrace:
    """Appends '<collection id> <seq> <applied at, epoch s>' per commit a replica applies, for measuring the lag
    from a commit to every process (commit times are in PostgreSQL's vector_commits)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.file = open(directory / f"replication-{os.getpid()}.log", "a", buffering=1 << 16)  # noqa: SIM115

    def applied(self, collection_id: int, seq: int, at: float) -> None:
        self.file.write(f"{collection_id} {seq} {at:.6f}\n")

    def close(self) -> None:
        self.file.close()


class StatusSend:
    """An ASGI send that remembers the status it sent (`default` until then)."""

    __slots__ = ("send", "status")

    def __init__(self, send: Send, default: int) -> None:
        self.send, self.status = send, default

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class HTTPMetricsMiddleware:
    """Pure ASGI, so it costs microseconds per request; labels by route template, never by raw path. Also writes
    the access log line (service/http/access_log.py) when asked: one wrapper for both."""

    def __init__(self, app: ASGIApp, metrics: Metrics, log_requests: bool = False) -> None:
        self.app = app
        self.metrics = metrics
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        watched = StatusSend(send, 500)
        try:
            await self.app(scope, receive, watched)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            elapsed = time.perf_counter() - start
            self.metrics.observe_request(template, scope["method"], watched.status, elapsed)
            if self.log_requests:
                log_request(scope, watched.status, elapsed)
