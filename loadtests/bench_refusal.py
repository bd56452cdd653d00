"""What a refusal costs the event loop: CPU per 503 written by the HTTP protocol for a request whose work class has
no slot and no room to wait.

    python loadtests/bench_refusal.py [--requests 5000] [--runs 5] [--over-tcp RATE [--seconds 5]]

Under overload most requests are refused, and f + (4 - f) r / s <= 1 says what that leaves to answer with at 4x
(docs/design/serving.md, "Refusals cost as little as the protocol can make them"). Two kinds: a claimed search
(refused once its body is read, `Express.answer_inline`) and an SSB query (refused from its headers,
`Express.refusal`). Reported: the least CPU per refusal over the runs (uvloop, as `switchyard serve` runs), the
kernel left out (no socket: requests are fed to the protocol's data_received). Two more: a search refused by a
front process's throttle for its engine (service/process/throttle.py), the throttle held refusing; and a search a
front sent over its link, refused by the engine process as the frame arrives (service/process/engine_host.py),
frames fed to the link's protocol.

--over-tcp RATE: the kernel counted in. A server process on the first core (the rest run the open-loop generator,
loadtests/openloop.py) refuses k=10 searches sent at RATE per second over keep-alive TCP loopback connections;
reported is its CPU per request, for uvicorn with this protocol (every class full) and for the floor: a bare uvloop
protocol that writes a fixed 503 for each request it finds, with no HTTP parser and no admission.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import uvicorn  # noqa: E402
import uvloop  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from loadtests import openloop  # noqa: E402
from loadtests.overload import searches  # noqa: E402
from service.errors import problem_json  # noqa: E402
from service.http.app import create_app  # noqa: E402
from service.http.express_protocol import ExpressProtocol  # noqa: E402
from service.process.engine_host import engine_server  # noqa: E402
from service.process.front import Front  # noqa: E402
from service.process.link import _EngineSide, frame  # noqa: E402
from service.process.links import EngineSockets, ProcessLinks  # noqa: E402
from service.process.messages import Request, SearchCall  # noqa: E402
from service.settings import Settings  # noqa: E402

SEARCH = b"/v1/collections/c128/search"
SSB = b"/v1/olap/ssb/queries/1.1"


class Sink:
    """A transport that counts writes."""

    def __init__(self) -> None:
        self.writes, self.closed = 0, False

    def write(self, data: bytes) -> None:
        self.writes += 1

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 5000) if name in ("peername", "sockname") else default


def request(path: bytes, dim: int = 128) -> bytes:
    body = b'{"vector": [' + b",".join(b"0.5" for _ in range(dim)) + b'], "k": 10}'
    return (b"POST " + path + b" HTTP/1.1\r\nhost: load\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


async def cost(path: bytes, n: int, runs: int, front: bool = False) -> float:
    """Least CPU seconds per refusal of `path` over `runs` runs of `n` requests, every class full (`front`: sent to
    a front process whose throttle refuses them)."""
    with tempfile.TemporaryDirectory(prefix="bench-refusal-") as data_dir:
        return await _cost(path, n, runs, data_dir, front)


def crowded_app(data_dir: str, loop: asyncio.AbstractEventLoop) -> Any:
    """The app with every work class's slots taken and every queue full: each /v1 request is refused."""
    app = create_app(Settings(data_dir=data_dir, max_inflight=4, inflight_latency_tolerance=0))
    for work in app.express.admission.classes.values():
        work.inflight = work.limit
        work.waiters.extend(loop.create_future() for _ in range(2 * work.limit))
    return app


def throttling_front(data_dir: str) -> Front:
    """A front process's app whose throttles refuse (almost) every call: its engine refused all it was sent."""
    folder = Path(data_dir)
    front = Front(Settings(data_dir=data_dir), ProcessLinks((EngineSockets(folder / "c.sock", folder / "h.sock"),)))
    for throttles in front.calls.throttles.values():
        for throttle in throttles.values():
            throttle.requests = 1e12
    return front


async def link_cost(n: int, runs: int) -> float:
    """Least CPU seconds per refusal of a front's search by the engine process, every class full: frames fed to the
    engine's end of the link."""
    with tempfile.TemporaryDirectory(prefix="bench-refusal-") as data_dir:
        runtime = crowded_app(data_dir, asyncio.get_running_loop()).state.switchyard
        server = engine_server(runtime, runtime.pipeline, Path(data_dir) / "engine.sock")
        side = _EngineSide(server.handlers, set(), set(), None, server.max_frame, 5.0, server.screen)
        sink = Sink()
        side.connection_made(sink)  # type: ignore[arg-type]
        query = np.random.default_rng(0).random(128, dtype=np.float32).tobytes()
        data, best = frame(Request(1, SearchCall("c128", query, 128, "vector", True))), float("inf")
        for _ in range(runs):
            started = time.process_time()
            for _ in range(n):
                written = sink.writes
                side.data_received(data)
                while sink.writes == written:  # answered by a task (no screen) rather than as it arrives
                    await asyncio.sleep(0)
            best = min(best, (time.process_time() - started) / n)
        return best


async def _cost(path: bytes, n: int, runs: int, data_dir: str, front: bool) -> float:
    loop = asyncio.get_running_loop()
    app = throttling_front(data_dir) if front else crowded_app(data_dir, loop)
    config = uvicorn.Config(app, http=ExpressProtocol, lifespan="off", log_level="warning", access_log=False)
    config.load()
    protocol = ExpressProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    sink = Sink()
    protocol.connection_made(sink)  # type: ignore[arg-type]
    raw, best = request(path), float("inf")
    for _ in range(runs):
        started = time.process_time()
        for _ in range(n):
            written = sink.writes
            protocol.data_received(raw)
            while sink.writes == written:  # refused by the app (an ASGI cycle, in a task) rather than the protocol
                await asyncio.sleep(0)
        best = min(best, (time.process_time() - started) / n)
    if sink.writes != n * runs:
        raise SystemExit(f"expected {n * runs} refusals, got {sink.writes}")
    return best


FLOOR_BODY = problem_json(503, "overloaded", "Overloaded", "the service is serving 4 light requests, the limit of "
                          "that work class; this one was not run", retry_after_s=1)
FLOOR_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\ndate: Sat, 28 Nov 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
               b"retry-after: 1\r\ncontent-type: application/problem+json\r\ncontent-length: %d\r\n\r\n"
               % len(FLOOR_BODY)) + FLOOR_BODY


class FixedRefusal(asyncio.Protocol):
    """The floor: a fixed 503 for each whole request (headers, then Content-Length bytes) found in what arrives."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.pending = b""

    def data_received(self, data: bytes) -> None:
        pending, whole = self.pending + data, 0
        while (end := pending.find(b"\r\n\r\n")) >= 0:
            at = pending.find(b"content-length: ", 0, end)
            length = int(pending[at + 16:pending.index(b"\r\n", at)]) if at >= 0 else 0
            if len(pending) < end + 4 + length:
                break
            pending, whole = pending[end + 4 + length:], whole + 1
        self.pending = pending
        if whole:
            self.transport.write(FLOOR_REPLY * whole)


def _serve_refusing(floor: bool, port: int, cpus: set[int], ready: Any, done: Any, cpu: Any) -> None:
    """A server process refusing every request until `done`; its CPU seconds from `ready` go to `cpu`."""
    os.sched_setaffinity(0, cpus)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        with tempfile.TemporaryDirectory(prefix="bench-refusal-") as data_dir:
            if floor:
                server: Any = await loop.create_server(FixedRefusal, "127.0.0.1", port, backlog=4096)
            else:
                config = uvicorn.Config(crowded_app(data_dir, loop), host="127.0.0.1", port=port, http=ExpressProtocol,
                                        lifespan="off", log_level="warning", access_log=False, backlog=4096)
                server = uvicorn.Server(config)
                serving = asyncio.create_task(server.serve())
                while not server.started:
                    await asyncio.sleep(0.05)
            started = time.process_time()
            ready.set()
            await loop.run_in_executor(None, done.wait)
            cpu.value = time.process_time() - started
            if floor:
                server.close()
            else:
                server.should_exit = True
                await serving

    uvloop.run(serve())


def over_tcp(rate: float, seconds: float) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--over-tcp needs two cores: one for the server, the rest for the generator")
    context = multiprocessing.get_context("spawn")
    requests = searches("c128", 128, 10, None)
    for name, floor in (("uvicorn + ExpressProtocol, every class full", False),
                        ("floor: a fixed 503 per request, bare uvloop", True)):
        ready, done, cpu = context.Event(), context.Event(), context.Value("d", 0.0)
        port = 18_000 + os.getpid() % 1000
        server = context.Process(target=_serve_refusing, args=(floor, port, {cores[0]}, ready, done, cpu))
        server.start()
        ready.wait()
        result = openloop.run(port, requests, seconds, rate=rate, cpus=set(cores[1:]), processes=1)
        done.set()
        server.join()
        if result["shed_share"] != 1.0 or result["errors"]:
            raise SystemExit(f"{name}: expected every request refused, got {result}")
        print(f"{name}: {cpu.value / result['sent'] * 1e6:.1f} us of CPU per refusal over TCP ({result['sent']} "
              f"requests at {rate:g}/s; generator late p99 {result['generator']['late_p99_ms']} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--over-tcp", type=float, metavar="RATE", help="refusals per second over TCP loopback")
    parser.add_argument("--seconds", type=float, default=5.0, help="--over-tcp: how long")
    args = parser.parse_args()
    if args.over_tcp:
        over_tcp(args.over_tcp, args.seconds)
        return
    for name, path, front in (("search (claimed, refused once its body is read)", SEARCH, False),
                              ("SSB query (refused from its headers)", SSB, False),
                              ("search refused by a front process's throttle", SEARCH, True)):
        seconds = uvloop.run(cost(path, args.requests, args.runs, front))
        print(f"{name}: {seconds * 1e6:.1f} us of CPU per refusal")
    seconds = uvloop.run(link_cost(args.requests, args.runs))
    print(f"search sent by a front, refused by the engine process as it arrives: {seconds * 1e6:.1f} us of CPU")


if __name__ == "__main__":
    main()
