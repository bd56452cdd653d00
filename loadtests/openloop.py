"""An open-loop HTTP load generator that runs in its own processes and reports how late it sent.

Each generator process sends its share of a fixed schedule (request i is due at start + i / rate, the processes
interleaved) over keep-alive HTTP/1.1 connections on loopback, opening another connection whenever none is idle, up
to MAX_CONNECTIONS per process; past that a due request waits for one (as wrk2 does). Latency counts from each
request's due time, so a request that waited, in the generator or in the service, shows it; the generator's own
lateness (send time minus due time, the wait for a connection included) is reported beside it. The schedule starts
0.2 s after every process has started, and each opens its first connections before it (a process still starting
was late for all its first requests: p99 lateness near a second on a 16-core machine). Without the cap, a service
falling behind made the generator open connections until they failed (23,071 of them at 4x k=10 searches).
Requests are pre-encoded bytes, answers are parsed only as far as status, Retry-After and length: the generator
spends as little of a shared machine as it can.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

import uvloop

HEAD_END = b"\r\n\r\n"
ANSWER_TIMEOUT_S = 30.0  # an answer later than this is counted as a TimeoutError
MAX_CONNECTIONS = 256  # per generator process
# One request's outcome: label, status (or the exception's name), whether a refusal had Retry-After, latency from
# its due time, the generator's lateness in sending it, and when it was due (seconds from the schedule's start).
Result = tuple[str, Any, bool, float, float, float]
PRE_OPEN_S = 0.01  # connections opened before the start: this many seconds of the process's requests


@dataclass(frozen=True)
class Request:
    label: str  # what it is, for per-label results
    raw: bytes  # the whole HTTP/1.1 request


def http_request(method: str, path: str, body: bytes, label: str, headers: dict[str, str] | None = None) -> Request:
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"{method} {path} HTTP/1.1\r\nhost: load\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n")
    return Request(label, head.encode() + body)


class Connection(asyncio.Protocol):
    """One keep-alive connection with at most one request outstanding; `finished` hears each answer (or failure)."""

    def __init__(self, finished: Callable[["Connection", Any, bool], None]) -> None:
        self.buffer = bytearray()
        self.finished = finished
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.outstanding: tuple[Request, float, float] | None = None  # the request sent, its due and send times

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: Request, due: float, sent: float) -> None:
        assert self.transport is not None
        self.outstanding = (request, due, sent)
        self.transport.write(request.raw)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(HEAD_END)
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None]) if at >= 0 else 0
        if len(self.buffer) < end + 4 + length:
            return
        del self.buffer[:end + 4 + length]
        if b"connection: close" in head:
            self.closed = True
        self.finished(self, int(head[9:12]), b"retry-after" in head)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.finished(self, "reset" if self.buffer or exc else "closed", False)


class Generator:
    """One process's sender: each request goes out on an idle connection when it is due, or on a new one (at most
    MAX_CONNECTIONS), or else waits for the next to come free (the generator's lateness). Callbacks, not a task per
    request: the generator's CPU per request is what bounds the rate one core can offer."""

    def __init__(self, port: int, requests: list[Request], start: float, stop: float, closed_loop: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.port, self.requests, self.start, self.stop = port, requests, start, stop
        self.closed_loop = closed_loop  # each answer sends the next request at once, until stop
        self.idle: list[Connection] = []
        self.connections: set[Connection] = set()
        self.opening = 0
        self.waiting: deque[tuple[int, float]] = deque()  # (request index, due): no connection free
        self.out: list[Result] = []
        self.sent_count = 0  # requests dispatched, and ...
        self.done_count = 0  # ... those with an outcome

    async def open_connections(self, n: int) -> None:
        for _ in range(min(MAX_CONNECTIONS, n)):
            connection = await self._connect()
            self.idle.append(connection)

    async def _connect(self) -> Connection:
        _, connection = await self.loop.create_connection(lambda: Connection(self._finished), "127.0.0.1", self.port)
        self.connections.add(connection)
        return connection

    def start_clients(self) -> None:
        """Closed loop: each open connection sends its client's first request (the next follows each answer)."""
        idle, self.idle = self.idle, []
        for connection in idle:
            self._free(connection)

    def dispatch(self, i: int, due: float) -> None:
        """Request i, due at `due` (monotonic): sent now if a connection is free or can be opened, else queued."""
        self.sent_count += 1
        while self.idle and self.idle[-1].closed:  # the service closed it (keep-alive timeout) while it was idle
            self.connections.discard(self.idle.pop())
        if self.idle:
            self.idle.pop().send(self.requests[i % len(self.requests)], due, time.monotonic())
            return
        self.waiting.append((i, due))
        if len(self.connections) + self.opening < MAX_CONNECTIONS:
            self._open_another()

    def _open_another(self) -> None:
        self.opening += 1
        self.loop.create_task(self._open_one())

    async def _open_one(self) -> None:
        try:
            connection = await self._connect()
        except OSError as exc:
            self.opening -= 1
            if self.waiting:  # the request it was opened for fails with the reason
                i, due = self.waiting.popleft()
                now = time.monotonic()
                self._record(self.requests[i % len(self.requests)], type(exc).__name__, False, due, now)
            return
        self.opening -= 1
        self._free(connection)

    def _finished(self, connection: Connection, status: Any, retry: bool) -> None:
        if connection.outstanding is None:
            return  # closed while idle
        (request, due, sent), connection.outstanding = connection.outstanding, None
        self._record(request, status, retry, due, sent)
        if connection.closed:
            self._drop(connection)
            if self.waiting and not self.opening:  # those waiting for a connection need another
                self._open_another()
            return
        self._free(connection)

    def _drop(self, connection: Connection, abort: bool = False) -> None:
        connection.closed = True
        self.connections.discard(connection)
        if connection.transport is not None:
            connection.transport.abort() if abort else connection.transport.close()

    def _free(self, connection: Connection) -> None:
        """A connection free for the next request: the longest waiting, or the next of a closed loop's client."""
        now = time.monotonic()
        if self.waiting:
            i, due = self.waiting.popleft()
            connection.send(self.requests[i % len(self.requests)], due, now)
        elif self.closed_loop and now < self.stop:
            self.sent_count += 1
            connection.send(self.requests[self.sent_count % len(self.requests)], now, now)
        else:
            self.idle.append(connection)

    def _record(self, request: Request, status: Any, retry: bool, due: float, sent: float) -> None:
        self.out.append((request.label, status, retry, time.monotonic() - due, sent - due, due - self.start))
        self.done_count += 1

    def expire(self) -> None:
        """Requests unanswered for ANSWER_TIMEOUT_S: a TimeoutError each, and their connection closed."""
        limit = time.monotonic() - ANSWER_TIMEOUT_S
        for connection in list(self.connections):
            if connection.outstanding is not None and connection.outstanding[2] < limit:
                (request, due, sent), connection.outstanding = connection.outstanding, None
                self._record(request, "TimeoutError", False, due, sent)
                self._drop(connection, abort=True)

    def close(self) -> None:
        for connection in self.connections:
            if connection.transport is not None:
                connection.transport.close()


async def _generate(port: int, requests: list[Request], rate: float, duration_s: float, index: int, processes: int,
                    clients: int, start: float) -> list[Result]:
    """This process's share: open loop at rate / processes (clients=0), or `clients` closed-loop clients."""
    stop = start + duration_s
    generator = Generator(port, requests, start, stop, closed_loop=bool(clients))
    # Connections opened before the schedule starts, as wrk2 does: enough for about 10 ms of its requests in flight.
    await generator.open_connections(clients or 1 + int(rate / processes * PRE_OPEN_S))
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    if clients:  # closed loop: each client's connection sends its next request when the last is answered
        generator.start_clients()
    else:  # every request due by now goes out in this wake-up; then a sleep until the next is due
        i = index
        while (due := start + i / rate) < stop:
            if (delay := due - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            generator.dispatch(i, due)
            i += processes
    while time.monotonic() < stop:
        await asyncio.sleep(min(1.0, stop - time.monotonic()))
    while generator.done_count < generator.sent_count:  # the answers still on their way, or expired
        await asyncio.sleep(0.05)
        generator.expire()
    generator.close()
    return generator.out


def _worker(conn: Any, args: tuple, cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    conn.send("ready")  # started and imported: the schedule's start comes once every process is
    start = conn.recv()
    cpu = time.process_time()
    results = uvloop.run(_generate(*args, start))  # as `switchyard serve` runs: its callbacks cost less
    conn.send((results, time.process_time() - cpu))
    conn.close()


def run(port: int, requests: list[Request], duration_s: float, rate: float = 0.0, clients: int = 0,
        processes: int = 2, cpus: set[int] | None = None) -> dict[str, Any]:
    """Open loop at `rate` per second (or `clients` closed-loop clients per process) for duration_s, from
    `processes` generator processes (on `cpus` only, if given); the summary of what came back."""
    context = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    for index in range(processes):
        mine, theirs = context.Pipe()
        worker = context.Process(target=_worker, args=(theirs, (port, requests, rate, duration_s, index, processes,
                                                                 clients), cpus), daemon=True)
        worker.start()
        pipes.append(mine)
        workers.append(worker)
    for pipe in pipes:  # a process still starting when the schedule began was late for all its first requests
        assert pipe.recv() == "ready"
    start = time.monotonic() + 0.2  # CLOCK_MONOTONIC: the same clock in every process
    for pipe in pipes:
        pipe.send(start)
    results: list[Result] = []
    cpu = 0.0
    for pipe, worker in zip(pipes, workers):
        part, seconds = pipe.recv()
        results += part
        cpu += seconds
        worker.join()
    # Answers per second from the schedule's start until the last answer came: a service that answers its backlog
    # after the schedule ended made those answers then, not within it.
    elapsed = max([duration_s, *(r[5] + r[3] for r in results)])
    summary = summarize(results, elapsed)
    summary.update(offered_per_s=rate or None, clients=clients * processes or None,
                   generator={"processes": processes, "cpu_share": round(cpu / elapsed, 2),
                              "late_p50_ms": ms(sorted(r[4] for r in results), 0.5),
                              "late_p99_ms": ms(sorted(r[4] for r in results), 0.99)})
    return summary


def ms(ordered: list[float], q: float) -> float | None:
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None


def answered(status: Any) -> bool:
    return isinstance(status, int) and status < 300


def refused(status: Any) -> bool:
    return status in (429, 503)


def summarize(results: list[Result], elapsed: float) -> dict[str, Any]:
    ok = [(label, latency) for label, status, _, latency, _, _ in results if answered(status)]
    shed = [(status, retry) for _, status, retry, _, _, _ in results if refused(status)]
    other = Counter(str(r[1]) for r in results if not (answered(r[1]) or refused(r[1])))
    labels = sorted({label for label, _ in ok})
    by_label = {label: sorted(lat for lab, lat in ok if lab == label) for label in labels}
    ordered = sorted(lat for _, lat in ok)
    return {"sent": len(results), "seconds": round(elapsed, 2), "admitted_per_s": round(len(ok) / elapsed, 1),
            "p50_ms": ms(ordered, 0.5), "p99_ms": ms(ordered, 0.99),
            "by_label": {label: {"admitted": len(v), "p50_ms": ms(v, 0.5), "p99_ms": ms(v, 0.99)}
                         for label, v in by_label.items()},
            "shed_share": round(len(shed) / max(1, len(results)), 4),
            "shed_without_retry_after": sum(1 for _, retry in shed if not retry), "errors": dict(other),
            "by_second": by_second(results)}


def by_second(results: list[Result]) -> list[dict[str, Any]]:
    """Each second of the schedule (by due time): requests answered, refused, and the answered ones' p50 and p99,
    which show how the service took the load's onset (a p99 over a whole run can be one bad second)."""
    seconds: dict[int, list[Result]] = {}
    for r in results:
        seconds.setdefault(int(r[5]), []).append(r)
    out = []
    for second in sorted(seconds):
        latencies = sorted(r[3] for r in seconds[second] if answered(r[1]))
        out.append({"second": second, "answered": len(latencies),
                    "refused": sum(1 for r in seconds[second] if refused(r[1])),
                    "p50_ms": ms(latencies, 0.5), "p99_ms": ms(latencies, 0.99)})
    return out
